"""Starting the engine rank processes (spawn), waiting until rank 0 is ready, watching them (a dead
or hung rank kills the rest: see monitor.py), and stopping them: on `shutdown`, and at the latest
when this interpreter exits (multiprocessing's own exit hook would otherwise wait for them
forever). A rank whose launching process dies exits by itself (orphan_watch.py)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from compiled_engine.config import EngineConfig
from compiled_engine.models.tp_fit import check_tp_size
from compiled_engine.ranks.entry import run_rank
from compiled_engine.ranks.messages import Fatal, Ready, Shutdown
from compiled_engine.ranks.monitor import RankMonitor
from compiled_engine.ranks.rank_spec import RankSpec
from compiled_engine.ranks.torchrun import TorchrunPlacement

EXPLAIN_WAIT_S = 5.0  # how long a reader that saw the channel end waits for the monitor's diagnosis
POLL_S = 0.5  # how often a blocked receive checks that the ranks are alive
EXIT_STOP_S = 2.0  # at interpreter exit, how long the ranks get to stop before they are terminated


class EngineStartError(RuntimeError):
    """The engine did not start; `detail`: the failing rank's traceback, when it sent one."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class StartupRefusal(EngineStartError):
    """A start the configuration rules out (a checkpoint this engine cannot load, a flag that does
    not fit the model): `compiled-engine serve` prints its one line and exits with code 2."""


class EngineFailure(RuntimeError):
    """A rank died, hung or failed: the engine is gone."""


def one_host_store_path() -> str:
    """A new file path for the ranks' torch.distributed FileStore (removed by the last rank)."""
    return os.path.join(tempfile.gettempdir(), f"compiled-engine-tp-{uuid.uuid4().hex}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineHandle:
    """The running ranks and the private channel to rank 0: `send` inputs (one message, or a list
    that reaches one step together), `recv` event lists. Both raise EngineFailure, explained, when
    the engine is gone; every client of the ranks (`RemoteEngine`, the server's `EngineClient`) goes
    through them."""

    conn: Connection
    procs: list[BaseProcess]
    ready: Ready
    monitor: RankMonitor
    # stops the ranks when the interpreter exits (registered with atexit until `shutdown`)
    at_exit: Callable[[], None] | None = None
    _send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: object) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError) as e:
            raise EngineFailure(
                self.explain(f"the channel to engine rank 0 closed ({e})")
            ) from None

    def recv(self) -> list:
        """The next event list (blocks; checks every POLL_S that the ranks are alive)."""
        try:
            while not self.conn.poll(POLL_S):
                if not self.is_alive():
                    raise EngineFailure(self.explain("an engine rank is gone"))
            return self.conn.recv()
        except (EOFError, OSError, ValueError):
            raise EngineFailure(self.explain("engine rank 0 exited")) from None

    def is_alive(self) -> bool:
        return self.monitor.failure is None and all(p.is_alive() for p in self.procs)

    @property
    def failure(self) -> str | None:
        return self.monitor.failure

    def explain(self, seen: str) -> str:
        """The reason the engine is gone, for a reader that saw `seen` (a Fatal or the channel's
        end): the monitor's diagnosis (which rank, how) first, once it has one."""
        if not self.monitor.stopping:
            self.monitor.failed.wait(EXPLAIN_WAIT_S)
        return seen if self.monitor.failure is None else f"{self.monitor.failure} ({seen})"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.at_exit is not None:
            atexit.unregister(self.at_exit)
        _stop_ranks(self.monitor, self.conn, self.procs, timeout_s)


def launch(
    config: EngineConfig,
    ready_timeout_s: float = 900.0,
    torchrun: TorchrunPlacement | None = None,
) -> EngineHandle:
    """Spawn `config.tp_size` ranks and return once rank 0 reports Ready (EngineStartError
    otherwise; a model that does not split over `tp_size` ranks before any rank starts).

    Under torchrun (`torchrun` given, this process is its rank 0) only engine rank 0 is spawned
    here: the other ranks are torchrun's other processes, met through `env://`. Only rank 0 is
    watched then: a remote rank that dies fails rank 0's next collective, one that hangs stalls
    rank 0's heartbeat."""
    world = config.tp_size
    try:
        check_tp_size(config.model, world)
    except ValueError as e:
        raise StartupRefusal(str(e)) from None
    ctx = mp.get_context("spawn")
    server_end, rank_end = ctx.Pipe(duplex=True)
    procs: list[BaseProcess] = []
    if torchrun is None:
        # the launcher's ranks share one host: they meet in a file (a TCP store would listen on
        # every interface), and gloo's sockets bind loopback (process_group.init_distributed)
        init_method = f"file://{one_host_store_path()}" if world > 1 else ""
        heartbeats = ctx.RawArray("d", world)
        specs = [RankSpec(r, world, init_method, config, heartbeats=heartbeats)
                 for r in range(world)]
    else:
        assert torchrun.rank == 0 and torchrun.world_size == world, torchrun
        heartbeats = ctx.RawArray("d", 1)
        specs = [RankSpec(0, world, "env://", config, torchrun.local_rank,
                          torchrun.local_world_size, heartbeats)]
    for spec in specs:
        conn = rank_end if spec.rank == 0 else None
        p = ctx.Process(target=run_rank, args=(spec, conn), name=f"engine-rank-{spec.rank}")
        p.start()
        procs.append(p)
    rank_end.close()
    # One rank has no peer to wait on: only its exit is watched (a long CPU step is not a hang).
    monitor = RankMonitor(procs, heartbeats if world > 1 else (), config.rank_timeout_s)
    # registered after multiprocessing's exit hook (imported to spawn), so it runs before it
    at_exit = functools.partial(_stop_ranks, monitor, server_end, procs, EXIT_STOP_S)
    atexit.register(at_exit)
    try:
        ready = _wait_ready(server_end, procs, ready_timeout_s)
    except BaseException:
        atexit.unregister(at_exit)
        _stop(server_end, procs, timeout_s=2.0)
        raise
    heartbeats[:] = [time.monotonic()] * len(heartbeats)
    monitor.start()
    return EngineHandle(server_end, procs, ready, monitor, at_exit)


def _wait_ready(conn: Connection, procs: list[BaseProcess], timeout_s: float) -> Ready:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                events = conn.recv()
            except EOFError:
                raise EngineStartError(
                    "engine rank 0 exited during start-up (see its log above)"
                ) from None
            for ev in events:
                if isinstance(ev, Ready):
                    return ev
                if isinstance(ev, Fatal):
                    raise (StartupRefusal if ev.refusal else EngineStartError)(ev.message,
                                                                               ev.detail)
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise EngineStartError(
                f"{dead[0].name} exited with code {dead[0].exitcode} during start-up"
            )
    raise EngineStartError(f"the engine did not start within {timeout_s:.0f}s")


def _stop_ranks(monitor: RankMonitor, conn: Connection, procs: list[BaseProcess],
                timeout_s: float) -> None:
    """An orderly stop: the monitor told first, so that the ranks' exits are not failures."""
    monitor.stop()
    _stop(conn, procs, timeout_s)


def _stop(conn: Connection, procs: list[BaseProcess], timeout_s: float) -> None:
    """Ask rank 0 to stop (it forwards the stop to every rank), join, then terminate and kill
    leftovers."""
    with contextlib.suppress(OSError, ValueError):
        conn.send(Shutdown())
    _join_all(procs, timeout_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
    _join_all(procs, 3.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(3.0)
    with contextlib.suppress(OSError):
        conn.close()


def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
