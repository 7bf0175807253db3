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
    """uvicorn with in-flight requests aborted on the first signal (so the graceful shutdown does
    not wait for long generations) and a plain exit 0 afterwards (uvicorn would re-raise the
    signal)."""

    def __init__(self, config: uvicorn.Config, announce: bool = True) -> None:
        super().__init__(config)
        self.announce = announce
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_dead_since: float | None = None

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
        """Also exit when the engine is gone (a rank died or hung): in-flight requests have failed
        with the reason, /health answers 503 for `engine_dead_exit_s`, then the server exits so that
        a process supervisor can restart it."""
        state = self._state()
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
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.abort_in_flight)

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

