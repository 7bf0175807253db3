"""Launcher-side watch over the rank processes: a rank that exits, or stops iterating its loop for
`timeout_s` (a hang), fails the whole engine: every rank is killed and the reason is recorded."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 1.0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankMonitor:
    """`heartbeats[rank]` is the `time.monotonic()` of that rank's latest loop iteration."""

    def __init__(
        self, procs: Sequence[BaseProcess], heartbeats: Sequence[float], timeout_s: float
    ) -> None:
        self.procs, self.heartbeats, self.timeout_s = procs, heartbeats, timeout_s
        self.failure: str | None = None
        self.failed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """An orderly shutdown is starting: exits from now on are expected."""
        self._stopping.set()

    def _run(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while not self._stopping.is_set():
            ready = wait(list(sentinels), timeout=CHECK_PERIOD_S)
            if self._stopping.is_set():
                return
            if ready:
                rank = min(sentinels[s] for s in ready)
                p = self.procs[rank]
                p.join(1.0)
                self._fail(f"engine rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}")
                return
            now = time.monotonic()
            for rank, beat in enumerate(self.heartbeats):
                if now - beat > self.timeout_s:
                    self._fail(
                        f"engine rank {rank} (pid {self.procs[rank].pid}) made no progress for "
                        f"{now - beat:.0f}s (rank_timeout_s={self.timeout_s:g}): it is hung"
                    )
                    return

    def _fail(self, reason: str) -> None:
        self.failure = f"{reason}; every engine rank was stopped"
        log.error("%s", self.failure)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)
        self.failed.set()
