"""Runs the batches, oldest first, one at a time: a batch is checked (`validating`), then its lines
go to the server's own endpoint handlers in this process (`in_process`), at most `concurrency` at
once (counted in sequences: a line with `n` 4 counts 4) and at the lowest priority where the
server schedules by priority; each answer is on disk before it counts (a restart goes on from the
last one), 2xx in the output file, the rest in the error file. An answer the server could not
give now (429 overloaded, 503 draining or engine gone) is not an answer: the line runs again
later, or after a restart. Past its completion window a batch expires; a cancelled one stops
taking lines and keeps those answered. A batch's answers are bounded: past `max_output_bytes`
each line left is an error line saying so, unrun; once the store's disk budget has no room for a
line, the batch stops there: the lines without an answer are counted failed, and the batch's
`errors` says why (one entry, not a line each)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from server.batch.lines import BatchLine, check_file, lines, sequences
from server.batch.store import ACTIVE, NO_OWNER, BatchStore
from server.request_errors import ProtocolError

log = logging.getLogger(__name__)
Execute = Callable[[str, dict], Awaitable[tuple[int, bytes]]]
Handler = Callable[[Request], Awaitable[Response]]
RETRY_S = 1.0  # after a 429 / 503
MAX_RETRIES = 120  # then the 429 / 503 is the line's answer
ROOM_POLL_S = 0.05  # while the server has no room for the batch's next request
COUNTS_EVERY_S = 0.5  # a running batch's counts are saved this often


def in_process(app: object, handlers: dict[str, Handler]) -> Execute:
    """Calls an endpoint's handler as an HTTP request would (the body as JSON), without a socket
    or the middleware (the batch was authorized when it was created); (status, body bytes)."""

    async def execute(url: str, body: dict) -> tuple[int, bytes]:
        raw = json.dumps(body, ensure_ascii=False).encode()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # no disconnect: the batch waits for its answer
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0), "app": app,
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode())]}
        response = await handlers[url](Request(scope, receive))
        return response.status_code, bytes(response.body)

    return execute


def answer_line(custom_id: str, status: int, body: bytes) -> bytes:
    """An output or error file's line (OpenAI's shape), the handler's body as it is."""
    head = json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})[:-1]
    return (f'{head}, "response": {{"status_code": {status}, "request_id": '
            f'"req_{uuid.uuid4().hex}", "body": ').encode() + body + b'}, "error": null}'


def refusal_line(custom_id: str, code: str, message: str) -> bytes:
    """An error file's line for a request that got no answer (OpenAI's shape: no response)."""
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": None, "error": {"code": code, "message": message}},
                      ensure_ascii=False).encode()


class _Flight:
    """The sequences a batch has in flight, at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self._freed = limit, 0, asyncio.Event()

    async def take(self, count: int) -> None:
        while self.used + count > self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.used += count

    def give(self, count: int) -> None:
        self.used -= count
        self._freed.set()


@dataclass
class _Output:
    """A running batch's answers so far, against its bound; whether the store has stopped it."""

    bytes: int
    limit: int
    full: tuple[str, str] | None = None  # (code, message) once the batch takes no more answers
    stopped: bool = False  # the store's disk budget had no room for a line: nothing more written

    def admit(self, size: int) -> bool:
        """Whether an answer of `size` bytes is kept (else `full` says why not)."""
        if self.full is None and self.bytes + size > self.limit:
            self.full = ("batch_output_too_large", f"the batch's answers reached their bound of "
                         f"{self.limit} bytes (--max-batch-output-mb): this request is not "
                         "answered")
        if self.full is not None:
            return False
        self.bytes += size
        return True


class BatchRunner:
    def __init__(self, store: BatchStore, execute: Execute, concurrency: int,
                 max_line_bytes: int, priority: int | None,
                 room: Callable[[int], bool] = lambda sequences: True,
                 max_output_bytes: int = 1 << 30) -> None:
        """`concurrency`: the sequences in flight at once; `priority`: set on every request (the
        lowest, under priority scheduling), or None; `room`: whether the server has room for a
        request of the batch's with that many sequences (it leaves admission to direct clients
        first); `max_output_bytes`: a batch's answers, both files together."""
        self.store = store
        self.execute = execute
        self.concurrency = concurrency
        self.max_line_bytes = max_line_bytes
        self.priority = priority
        self.room = room
        self.max_output_bytes = max_output_bytes
        self._broken: set[str] = set()  # batches that could not even be marked failed
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()  # status changes: the runner's and a cancel's, one at a time
        self._saved = 0.0  # when the running batch's counts were last saved
        self._running: dict | None = None  # the batch running now, as it is (counts live)

    def wake(self) -> None:
        """A batch was created."""
        self._wakeup.set()

    async def cancel(self, batch_id: str, owner: str) -> dict:
        """Mark `owner`'s waiting or running batch `cancelling` (409 for one that is not); the
        runner stops taking its lines and closes it `cancelled` with the answers it has."""
        async with self._lock:
            batch = self._live(batch_id, owner) or await asyncio.to_thread(
                self.store.batch, batch_id, owner)
            if batch["status"] not in ("validating", "in_progress"):
                raise ProtocolError(f"a batch that is {batch['status']} cannot be cancelled", None,
                                    status=409, code="batch_not_cancellable")
            batch |= {"status": "cancelling", "cancelling_at": _now()}
            await asyncio.to_thread(self.store.put_batch, batch)
        self._wakeup.set()
        return dict(batch)

    def live(self, batch_id: str, owner: str) -> dict | None:
        """`owner`'s running batch's object as it is now (its counts ahead of its saved copy)."""
        batch = self._live(batch_id, owner)
        return None if batch is None else dict(batch)

    def _live(self, batch_id: str, owner: str) -> dict | None:
        running = self._running
        if running is None or running["id"] != batch_id:
            return None
        return running if running.get("owner", NO_OWNER) == owner else None

    async def run_forever(self) -> None:
        while True:
            try:
                batch = await asyncio.to_thread(self._oldest_active)
                if batch is None:
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                self._running = batch
                try:
                    await self.run_batch(batch)
                except Exception as e:  # the disk, most likely: the batch fails, the server serves
                    log.exception("batch %s failed", batch["id"])
                    self._broken.add(batch["id"])  # until it is marked failed
                    await self._put(batch, status="failed", failed_at=_now(), errors={
                        "object": "list", "data": [{"code": "server_error",
                                                    "message": str(e)[:500], "param": None,
                                                    "line": None}]})
                    self._broken.discard(batch["id"])
                finally:
                    self._running = None
            except Exception:  # even that failed: log it, and try again later
                log.exception("the batch runner failed")
                await asyncio.sleep(RETRY_S)

    def _oldest_active(self) -> dict | None:
        active = [b for b in self.store.list_batches(None)
                  if b["status"] in ACTIVE and b["id"] not in self._broken]
        return min(active, key=lambda b: (b["created_at"], b["id"])) if active else None

    async def run_batch(self, batch: dict) -> None:
        bid, path = batch["id"], self.store.file_path(batch["input_file_id"])
        if batch["status"] == "validating":
            count, errors = await asyncio.to_thread(check_file, path, batch["endpoint"],
                                                    self.max_line_bytes)
            if errors:
                await self._put(batch, status="failed", failed_at=_now(),
                                errors={"object": "list", "data": errors})
                return
            batch["request_counts"]["total"] = count
            await self._put(batch, status="in_progress", in_progress_at=_now())
        done = await asyncio.to_thread(self.store.answered, bid)
        counts = batch["request_counts"]
        counts["completed"], counts["failed"] = len(done["output"]), len(done["errors"])
        answered = done["output"] | done["errors"]
        output = _Output(await asyncio.to_thread(self.store.answers_bytes, bid),
                         self.max_output_bytes)
        flight = _Flight(self.concurrency)
        running: set[asyncio.Task] = set()
        todo = lines(path, batch["endpoint"], self.max_line_bytes)
        try:
            while self._taking(batch) and not output.stopped:
                line = await asyncio.to_thread(next, todo, None)
                if line is None:
                    break
                if line.custom_id in answered:
                    continue
                if output.full is not None:  # past a bound: the line is not run
                    await self._answer(batch, "errors", refusal_line(line.custom_id,
                                                                     *output.full), output)
                    continue
                count = min(sequences(line), self.concurrency)
                await flight.take(count)
                while not self.room(count) and self._taking(batch) and not output.stopped:
                    await asyncio.sleep(ROOM_POLL_S)
                if output.stopped:
                    flight.give(count)
                    break
                task = asyncio.create_task(self._one(batch, line, output))
                running.add(task)
                task.add_done_callback(lambda t, n=count: (running.discard(t), flight.give(n)))
            if running:
                await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
        await self._finish(batch, output.stopped)

    def _taking(self, batch: dict) -> bool:
        """Whether the batch takes more lines (not cancelled, not past its window)."""
        return batch["status"] == "in_progress" and time.time() < batch["expires_at"]

    async def _one(self, batch: dict, line: BatchLine, output: _Output) -> None:
        body = line.body if self.priority is None else line.body | {"priority": self.priority}
        for _ in range(MAX_RETRIES):
            status, payload = await self.execute(line.url, body)
            if status not in (429, 503) or not self._taking(batch):
                break
            await asyncio.sleep(RETRY_S)
        if status in (429, 503) and not self._taking(batch):
            return  # cancelled or expired while the server could not answer: not answered
        kind, answer = "output" if status < 400 else "errors", answer_line(line.custom_id, status,
                                                                          payload)
        if not output.admit(len(answer) + 1):
            kind, answer = "errors", refusal_line(line.custom_id, *output.full)
        await self._answer(batch, kind, answer, output)

    async def _answer(self, batch: dict, kind: str, answer: bytes, output: _Output) -> None:
        """One line answered: on disk, then counted; none once the store has stopped the batch
        (the line is then counted with the rest when the batch ends)."""
        if output.stopped or not await asyncio.to_thread(self.store.append_answer, batch["id"],
                                                         kind, answer):
            output.stopped = True
            return
        batch["request_counts"]["completed" if kind == "output" else "failed"] += 1
        if time.monotonic() - self._saved >= COUNTS_EVERY_S:  # (a restart counts the files)
            self._saved = time.monotonic()
            await self._put(batch)

    async def _finish(self, batch: dict, stopped: bool) -> None:
        """Keep the answers as files and close the batch: completed, cancelled or expired
        (`stopped`, by the store's disk budget: completed, the lines without an answer failed).
        The files' ids are saved before the answers move, so that a restart in between finishes
        the move instead of losing them."""
        async with self._lock:
            status = batch["status"]
            counts = batch["request_counts"]
            left = counts["total"] - counts["completed"] - counts["failed"]
            if stopped and status != "cancelling" and left > 0:
                counts["failed"] += left
                batch["errors"] = {"object": "list", "data": [{
                    "code": "batch_store_full", "param": None, "line": None,
                    "message": f"the Batch API's store is full (--batch-disk-gb): {left} requests "
                               "were not answered and are in neither the output nor the error "
                               "file"}]}
            whole = counts["completed"] + counts["failed"] >= counts["total"]
            ending = ("cancelled" if status == "cancelling" else "completed" if whole
                      else "expired")
            ids = {kind: batch.get(key) or f"file-{uuid.uuid4().hex}"
                   for kind, key in (("output", "output_file_id"), ("errors", "error_file_id"))}
            batch |= {"output_file_id": ids["output"], "error_file_id": ids["errors"]}
            if status != "cancelling":
                batch |= {"status": "finalizing", "finalizing_at": batch.get("finalizing_at")
                          or _now()}
            await asyncio.to_thread(self.store.put_batch, batch)
        owner = batch.get("owner", NO_OWNER)
        output = await asyncio.to_thread(self.store.keep_answers, batch["id"], "output",
                                         ids["output"], owner)
        errors = await asyncio.to_thread(self.store.keep_answers, batch["id"], "errors",
                                         ids["errors"], owner)
        await self._put(batch, status=ending, output_file_id=output, error_file_id=errors,
                        **{f"{ending}_at": _now()})

    async def _put(self, batch: dict, **changes: object) -> None:
        async with self._lock:
            batch.update(changes)
            await asyncio.to_thread(self.store.put_batch, batch)


@dataclass
class Batches:
    """The Batch API's store and runner, as the endpoints reach them."""

    store: BatchStore
    runner: BatchRunner


def _now() -> int:
    return int(time.time())


@contextlib.asynccontextmanager
async def running(runner: BatchRunner):
    """The runner on a task while the server serves."""
    task = asyncio.create_task(runner.run_forever(), name="batches")
    try:
        yield runner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
