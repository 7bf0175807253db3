"""A client that stops reading is dropped: each body chunk the server sends must be taken within
`send_timeout_s` (nginx's `send_timeout`, 60 s by default), else the send raises `TimeoutError`,
which ends the response: a stream's generators close, which aborts its engine requests and frees
their pages, and the connection is closed."""

from __future__ import annotations

import logging

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class SendTimeoutMiddleware:
    def __init__(self, app: ASGIApp, send_timeout_s: float) -> None:
        self.app, self.timeout = app, send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed_send(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                with anyio.fail_after(self.timeout):
                    await send(message)
            except TimeoutError:
                log.warning("dropped a client of %s that read nothing for %.0f s", scope["path"],
                            self.timeout)
                raise

        await self.app(scope, receive, timed_send)
