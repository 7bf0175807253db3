"""The asyncio side of the channel to engine rank 0.

A reader thread receives event lists and hands each event to its request group's asyncio queue
on the event loop. Requests are opened in groups (the `n` choices of one HTTP request); the routing
entry of each (rid -> its group's queue) is the server's only registry of requests, and a group's
exit always removes them and aborts whatever is still running in the engine (client gone, error,
cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from compiled_engine.ranks.launcher import EngineFailure, EngineHandle
from compiled_engine.ranks.messages import (
    Abort,
    Add,
    Fatal,
    Finish,
    LoadLora,
    LoraReply,
    RequestError,
    StatsReply,
    StatsRequest,
    UnloadLora,
)
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import TokenEvent


class EngineDead(RuntimeError):
    """The engine processes are gone: every in-flight request fails with this."""


class EngineRejected(ValueError):
    """The engine refused one request (e.g. it can never fit the KV pool). `field`: "structured"
    when its constraint did not compile (`RequestError.field`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Overloaded(RuntimeError):
    pass


class Submission(Protocol):
    """What the engine is sent of one sub-request (the server's record of it,
    `generation.Choice`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    lora_name: str | None


class RequestGroup:
    """The live sub-requests of one HTTP request; iterate `events()` until every one has
    finished."""

    def __init__(self, client: EngineClient, rids: list[str]) -> None:
        self._client = client
        self.queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.pending = list(rids)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Events of the pending sub-requests (late events of ones the server finished are
        dropped)."""
        while self.pending:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.rid not in self.pending:
                continue
            if item.finished:
                self.pending.remove(item.rid)
            yield item

    def finish(self, rid: str) -> None:
        """A stop string matched in the server: end the request in the engine (no event comes
        back)."""
        if rid in self.pending:
            self.pending.remove(rid)
            self._client.send(Finish(rid, "stop"))


class EngineClient:
    def __init__(self, handle: EngineHandle, max_in_flight: int) -> None:
        self.handle = handle
        self.max_in_flight = max_in_flight
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiters: dict[int, asyncio.Future] = {}  # token -> a stats or LoRA reply's future
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.draining = False  # shutting down: no new requests, those in flight finish
        self._recent: tuple[float, StatsReply] | None = None
        self._stats_task: asyncio.Future[StatsReply] | None = None
        self.round_trips = 0  # calls sent to rank 0 (stats, LoRA)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    async def close(self) -> None:
        """Fail what is in flight, then stop the rank processes."""
        self._die("the server is shutting down")
        await asyncio.to_thread(self.handle.shutdown)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5.0)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.handle.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open(self, subs: Sequence[Submission]) -> AsyncIterator[RequestGroup]:
        """Send the sub-requests of one HTTP request; the group's exit (the one way out: finished,
        client gone, error, cancellation) removes their routing entries and aborts whatever still
        runs."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        if self.draining:
            raise EngineDead("the server is shutting down: retry on another replica")
        if len(subs) > self.max_in_flight:  # never fits, however long the client waits
            raise EngineRejected(
                f"this request asks for {len(subs)} sequences and the server runs at most "
                f"{self.max_in_flight} at once (--max-queue): ask for fewer"
            )
        if self.num_in_flight + len(subs) > self.max_in_flight:
            raise Overloaded(
                f"the server is overloaded: {self.num_in_flight} sequences in flight, this request "
                f"adds {len(subs)} and the limit (--max-queue) is {self.max_in_flight}; retry later"
            )
        group = RequestGroup(self, [s.rid for s in subs])
        for s in subs:
            self._queues[s.rid] = group.queue
        try:
            for s in subs:
                self.send(Add(s.rid, s.prompt_ids, s.params, s.lora_name))
            yield group
        finally:
            for s in subs:
                self._queues.pop(s.rid, None)
            for rid in group.pending:
                with contextlib.suppress(EngineDead):
                    self.send(Abort(rid))

    def send(self, msg: object) -> None:
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        try:
            self.handle.send(msg)
        except EngineFailure as e:
            self._die(str(e))
            raise EngineDead(self.dead_reason) from None

    async def stats(self, timeout_s: float, check_integrity: bool = False) -> StatsReply:
        """A round trip to rank 0 (also the health ping); `check_integrity` adds the ledger's full
        check."""
        return await self._call(lambda token: StatsRequest(token, check_integrity), timeout_s)

    async def load_lora(self, name: str, path: str, timeout_s: float,
                        root: str | None = None) -> LoraReply:
        """Every rank reads, checks and serves the adapter (or none does: the reply says why);
        `root`: the folder `path` must still resolve inside (`LoadLora.root`)."""
        return await self._call(lambda token: LoadLora(token, name, path, root), timeout_s)

    async def unload_lora(self, name: str, timeout_s: float) -> LoraReply:
        return await self._call(lambda token: UnloadLora(token, name), timeout_s)

    async def _call(self, make: Callable[[int], object],
                    timeout_s: float) -> StatsReply | LoraReply:
        """Send `make(token)` to rank 0 and wait for its reply with that token."""
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[token] = fut
        self.round_trips += 1
        try:
            self.send(make(token))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiters.pop(token, None)

    async def recent_stats(self, max_age_s: float, timeout_s: float) -> StatsReply:
        """Stats at most `max_age_s` old: concurrent callers share one round trip, and callers
        within `max_age_s` of the last reply get it (a /health poll costs the engine nothing)."""
        if self._recent is not None and time.monotonic() - self._recent[0] <= max_age_s:
            return self._recent[1]
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self.stats(timeout_s))
        reply = await asyncio.shield(self._stats_task)
        self._recent = (time.monotonic(), reply)
        return reply

    # ---- events (reader thread -> loop) -------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                events = self.handle.recv()
            except EngineFailure as e:
                reason = str(e)  # which rank died or hung, from the launcher's monitor
                break
            fatal = next((ev for ev in events if isinstance(ev, Fatal)), None)
            try:
                self._loop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return
            if fatal is not None:
                reason = self.handle.explain(fatal.message)
                break
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._die, reason)

    def _dispatch(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, TokenEvent):
                q = self._queues.get(ev.rid)
                if q is not None:
                    q.put_nowait(ev)
            elif isinstance(ev, RequestError):
                q = self._queues.get(ev.rid)
                if q is not None:
                    q.put_nowait(EngineRejected(ev.message, ev.field))
            elif isinstance(ev, StatsReply | LoraReply):
                fut = self._waiters.get(ev.token)
                if fut is not None and not fut.done():
                    fut.set_result(ev)

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        """End every in-flight request with EngineDead (each waiting client gets a clear error)."""
        for q in {id(q): q for q in self._queues.values()}.values():
            q.put_nowait(EngineDead(reason))
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
