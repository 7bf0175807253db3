"""Every output constraint is compiled once in a worker process before the engine sees it.

A constraint that does not compile is a 400 naming its field; one whose compile runs past
`--grammar-compile-timeout` is a 400 too, and the worker is killed (a fresh one starts on the next
constraint); one that ends the worker (past its memory limit, `--grammar-compile-memory`, or its CPU
backstop, or a crash) is a 400 as well. So the engine's ranks only compile constraints known to
compile within the budget, and they do it outside their steps
(`compiled_engine.ranks.grammar_wait`). Verdicts are cached by the constraint's text: a constraint
seen before is answered at once (a timeout or a dead worker for FAILURE_VERDICT_S, since a loaded
machine may have caused it). One worker compiles one constraint at a time; at most MAX_PENDING
wait for it (then 429); requests without a constraint never wait for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from compiled_engine.grammar_worker import MEMORY_BYTES, OUT_OF_MEMORY_EXIT, READY, serve_compiles
from compiled_engine.sampling_params import StructuredOutput
from server.engine_client import Overloaded
from server.request_errors import ProtocolError

MAX_VERDICTS = 4096  # constraints whose verdict is remembered (LRU)
MAX_PENDING = 64  # constraints waiting for the worker before a 429
FAILURE_VERDICT_S = 600.0  # how long a timeout or a dead worker is remembered
WORKER_START_S = 300.0  # the worker's start (imports, the tokenizer): outside the budget
CPU_PAST_TIMEOUT_S = 10.0  # the worker's CPU limit per compile, beyond the wall-clock budget


class GrammarChecker:
    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 timeout_s: float, memory_bytes: int = MEMORY_BYTES) -> None:
        """`model_path`, `vocab_size`, `stop_token_ids`: as the engine's GrammarBook has them (the
        worker compiles exactly what the ranks will); `memory_bytes`: what one compile may allocate
        in the worker."""
        self.model_path, self.vocab_size = model_path, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.compiles = 0  # constraints sent to a worker (the rest were answered from the cache)
        self.starts = 0  # workers started
        self.pending = 0  # constraints waiting for the worker or in it
        # key -> (the 400's message or None, when it expires or None)
        self._verdicts: OrderedDict[bytes, tuple[str | None, float | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, "grammar-check")
        self._worker: multiprocessing.Process | None = None
        self._conn: Connection | None = None

    async def check(self, spec: StructuredOutput, field: str | None) -> None:
        """A 400 naming `field` unless `spec` compiles within the budget; Overloaded when
        MAX_PENDING constraints wait already."""
        key = _key(spec)
        verdict = self._cached(key)
        if verdict is _UNKNOWN:
            if self.pending >= MAX_PENDING:
                raise Overloaded(f"{self.pending} output constraints are waiting to be compiled; "
                                 "retry later")
            self.pending += 1
            try:
                verdict = await asyncio.wrap_future(self._thread.submit(self._compile, spec, key))
            finally:
                self.pending -= 1
        if verdict is not None:
            raise ProtocolError(verdict, field)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._stop_worker()

    # ---- on the checker's thread ----------------------------------------------------------------
    def _compile(self, spec: StructuredOutput, key: bytes) -> str | None:
        verdict = self._cached(key)  # the same constraint may have queued twice
        if verdict is not _UNKNOWN:
            return verdict
        conn = self._connection()
        self.compiles += 1
        expires = None
        try:
            conn.send(spec)
            if conn.poll(self.timeout_s):
                verdict = conn.recv()
            else:
                self._stop_worker()
                verdict = (f"the constraint did not compile within {self.timeout_s:g} s (the "
                           "server's --grammar-compile-timeout): make it smaller or simpler")
                expires = time.monotonic() + FAILURE_VERDICT_S
        except (EOFError, OSError):  # the worker died on it: out of memory, out of CPU, a crash
            verdict = self._death()
            expires = time.monotonic() + FAILURE_VERDICT_S
        with self._lock:
            self._verdicts[key] = (verdict, expires)
            if len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
        return verdict

    def _connection(self) -> Connection:
        worker, conn = self._worker, self._conn
        if conn is not None and worker is not None and worker.is_alive():
            return conn
        self._stop_worker()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        worker = ctx.Process(
            target=serve_compiles, name="grammar-check", daemon=True,
            args=(child, self.model_path, self.vocab_size, self.stop_token_ids,
                  self.memory_bytes, self.timeout_s + CPU_PAST_TIMEOUT_S),
        )
        worker.start()
        self.starts += 1
        child.close()
        self._worker, self._conn = worker, parent
        try:
            started = parent.poll(WORKER_START_S) and parent.recv() == READY
        except (EOFError, OSError):
            started = False
        if not started:
            self._stop_worker()
            raise ProtocolError("the server could not start its constraint compiler", status=503,
                                kind="server_error")
        return parent

    def _death(self) -> str:
        """The 400's message for the constraint the worker died on (it is stopped)."""
        worker = self._worker
        if worker is not None:
            worker.join(10)
        code = None if worker is None else worker.exitcode
        self._stop_worker()
        if code == OUT_OF_MEMORY_EXIT:
            return (f"the constraint needs more than {self.memory_bytes / 2**20:g} MiB to compile "
                    "(the server's --grammar-compile-memory): make it smaller or simpler")
        return (f"the constraint made the server's constraint compiler fail{_cause(code)}: make "
                "it smaller or simpler")

    def _stop_worker(self) -> None:
        worker, conn = self._worker, self._conn
        self._worker = self._conn = None
        if worker is not None:
            worker.kill()
            worker.join(10)
        if conn is not None:
            conn.close()

    def _cached(self, key: bytes) -> str | None | object:
        with self._lock:
            entry = self._verdicts.get(key)
            if entry is None or (entry[1] is not None and time.monotonic() >= entry[1]):
                return _UNKNOWN
            self._verdicts.move_to_end(key)
            return entry[0]


_UNKNOWN = object()


def _cause(exitcode: int | None) -> str:
    """` (SIGXCPU)` for a worker a signal ended, else nothing."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        return f" (signal {-exitcode})"


def _key(spec: StructuredOutput) -> bytes:
    text = json.dumps([spec.kind, spec.spec, spec.strict], ensure_ascii=False)
    return hashlib.sha256(text.encode()).digest()
