"""Every output constraint is compiled once in a worker process before the engine sees it.

A constraint that does not compile is a 400 naming its field; one whose compile runs past
`--grammar-compile-timeout` is a 400 too, and the worker is killed (a fresh one starts on the next
constraint). So the engine's ranks only compile constraints known to compile within the budget, and
they do it outside their steps (`compiled_engine.ranks.grammar_wait`). Verdicts are cached by the
constraint's text: a constraint seen before is answered at once (a timeout for TIMEOUT_VERDICT_S,
since a loaded machine may have caused it). One worker compiles one constraint at a time; at most
MAX_PENDING wait for it (then 429); requests without a constraint never wait for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from compiled_engine.grammar_worker import READY, serve_compiles
from compiled_engine.sampling_params import StructuredOutput
from server.engine_client import Overloaded
from server.request_errors import ProtocolError

MAX_VERDICTS = 4096  # constraints whose verdict is remembered (LRU)
MAX_PENDING = 64  # constraints waiting for the worker before a 429
TIMEOUT_VERDICT_S = 600.0  # how long a timeout is remembered
WORKER_START_S = 300.0  # the worker's start (imports, the tokenizer): outside the budget


class GrammarChecker:
    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 timeout_s: float) -> None:
        """`model_path`, `vocab_size`, `stop_token_ids`: as the engine's GrammarBook has them (the
        worker compiles exactly what the ranks will)."""
        self.model_path, self.vocab_size = model_path, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.compiles = 0  # constraints sent to a worker (the rest were answered from the cache)
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
                expires = time.monotonic() + TIMEOUT_VERDICT_S
        except (EOFError, OSError):  # the worker died (killed, out of memory): not remembered
            self._stop_worker()
            raise ProtocolError("the server's constraint compiler failed on this constraint",
                                status=503, kind="server_error") from None
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
            args=(child, self.model_path, self.vocab_size, self.stop_token_ids),
        )
        worker.start()
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


def _key(spec: StructuredOutput) -> bytes:
    text = json.dumps([spec.kind, spec.spec, spec.strict], ensure_ascii=False)
    return hashlib.sha256(text.encode()).digest()
