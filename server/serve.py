"""Running the app under uvicorn in this process: URL printed when ready, graceful
SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import FrameType

import uvicorn

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


def serve(
    config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> int:
    app = create_app(config)
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
    server.run()
    return 0 if server.started and server.engine_dead_since is None else 1

