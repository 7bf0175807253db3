"""Responses that end their work when the client goes away: an SSE stream, and a helper for plain
requests.

Both watch ASGI `receive()` for `http.disconnect` and cancel the work; the work's generators are
closed in `finally`, which aborts the engine requests (independent of how the server reports
disconnects)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream:
    """`text/event-stream` response; each item of `chunks` is one already framed `data: ...\\n\\n`
    event."""

    status_code = 200

    def __init__(self, chunks: AsyncIterator[str]) -> None:
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                with contextlib.suppress(OSError):  # the client went away while we were writing
                    async for chunk in self.chunks:
                        await send(
                            {
                                "type": "http.response.body",
                                "body": chunk.encode(),
                                "more_body": True,
                            }
                        )
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; if the client disconnects first, cancel it and raise ClientGone."""
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    task = asyncio.ensure_future(work())
    try:
        await asyncio.wait({watcher, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
