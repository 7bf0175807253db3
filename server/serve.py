"""Running the app under uvicorn in this process: URL printed when ready, graceful
SIGINT/SIGTERM; a start the configuration rules out (`StartupRefusal`) is one line on stderr and
exit code 2 (its tracebacks too with `--log-level debug`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import sys
import time
import traceback
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compiled_engine.ranks.launcher import EngineStartError, StartupRefusal
from server.app import create_app
from server.state import ServerConfig, ServerState

log = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """uvicorn that drains on the first signal (`handle_exit`) and exits 0 afterwards (uvicorn
    would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, announce: bool = True) -> None:
        super().__init__(config)
        self.announce = announce
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_dead_since: float | None = None
        self.drain_started: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.announce:
            host, port = self.config.host, self.servers[0].sockets[0].getsockname()[1]
            print(f"compiled-engine is serving at http://{host}:{port}  "
                  f"(OpenAI base URL: http://{host}:{port}/v1; "
                  f"chat page: http://{host}:{port}/)",
                  flush=True)

    async def on_tick(self, counter: int) -> bool:
        """Exit when a drain is over, and when the engine is gone (a rank died or hung): in-flight
        requests have failed with the reason, /health answers 503 for `engine_dead_exit_s`, then
        the server exits so that a process supervisor can restart it."""
        state = self._state()
        if state is not None and self.drain_started is not None and self._drained(state):
            return True
        if state is not None and state.client.dead_reason is not None:
            now = time.monotonic()
            if self.engine_dead_since is None:
                self.engine_dead_since = now
                log.error("the engine failed: %s; exiting in %gs", state.client.dead_reason,
                          state.config.engine_dead_exit_s)
            if now - self.engine_dead_since >= state.config.engine_dead_exit_s:
                return True
        return await super().on_tick(counter)

    def _state(self) -> ServerState | None:
        return (
            getattr(self.config.app.state, "server", None)
            if hasattr(self.config.app, "state")
            else None
        )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first SIGTERM / SIGINT drains: /health answers 503, new requests 503, those in
        flight finish for up to `shutdown_timeout_s` (then end with an error event), then the
        server exits. A second signal exits at once."""
        state = self._state()
        if self.should_exit or self.drain_started is not None or state is None:
            self.should_exit = self.force_exit = True
            return
        self.drain_started = time.monotonic()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(setattr, state.client, "draining", True)
        log.warning("shutting down: %d sequences in flight get up to %gs to finish",
                    state.client.num_in_flight, state.config.shutdown_timeout_s)

    def _drained(self, state: ServerState) -> bool:
        """Whether a drain is over: nothing in flight, or its time is up (the rest failed)."""
        if not state.client.num_in_flight:
            return True
        if time.monotonic() - self.drain_started >= state.config.shutdown_timeout_s:
            self.abort_in_flight()
            return True
        return False

    def abort_in_flight(self) -> None:
        state = self._state()
        if state is not None:
            state.client.fail_all("the server is shutting down")


class RefusalCatcher(logging.Filter):
    """The app, with a StartupRefusal in its lifespan caught: Starlette's traceback of it and
    uvicorn's lines about the failed start are left out of the log (`serve` reports it)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__()
        self.app = app
        self.refusal: StartupRefusal | None = None

    def __getattr__(self, name: str) -> object:  # the app's `state` and the rest
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            send = functools.partial(self._lifespan_send, send)
        await self.app(scope, receive, send)

    async def _lifespan_send(self, send: Send, message: Message) -> None:
        error = sys.exc_info()[1]  # Starlette reports a failed start from its `except` block
        if message["type"] == "lifespan.startup.failed" and isinstance(error, StartupRefusal):
            self.refusal = error
            message = message | {"message": ""}
        await send(message)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.refusal is None


def refuse(error: BaseException, log_level: str) -> int:
    """Print a refused start as one line on stderr (after its tracebacks, the failing rank's
    included, at `debug` or `trace`); the exit code 2."""
    if log_level in ("debug", "trace"):
        traceback.print_exception(error, file=sys.stderr)
        if isinstance(error, EngineStartError) and error.detail:
            print(error.detail, file=sys.stderr, end="")
    print(f"compiled-engine serve: error: {error}", file=sys.stderr, flush=True)
    return 2


def serve(
    config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> int:
    app = RefusalCatcher(create_app(config))
    server = Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=10,
            lifespan="on",
        )
    )
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(app)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit after a failed start
        if app.refusal is None:
            raise
    finally:
        uvicorn_log.removeFilter(app)
    if app.refusal is not None:
        return refuse(app.refusal, log_level)
    return 0 if server.started and server.engine_dead_since is None else 1

