"""Real servers on 127.0.0.1 for the tests (uvicorn in a background thread, engine ranks in spawned
processes), and what the tests read from them. A test's server lives in a fixture that stops it
(yield, then `stop()`) or in `with start_server(...) as running:`; the launcher also stops the
ranks of any server left running when the interpreter exits."""

from __future__ import annotations

import atexit
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import uvicorn

from compiled_engine.config import EngineConfig
from server.app import create_app
from server.serve import Server
from server.state import ServerConfig

# What `serve` runs by default: compiled; deterministic stated, since the HTTP tests compare answers
# across batches (on a device whose default is off, `--no-deterministic` has its own server:
# test_no_deterministic.py). Every server of the suite shares one compile (the compile cache and
# inductor's cache; CI keeps both under .cache/).
ENGINE = dict(model="demo", num_pages=8192, max_running=32, seed=0, deterministic=True)


@dataclass
class RunningServer:
    url: str
    server: Server
    thread: threading.Thread

    @property
    def state(self):
        return self.server.config.app.state.server

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0, **kwargs)

    def openai(self) -> openai.OpenAI:
        """The official client, no retries (a failure shows as it is)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def stop(self) -> None:
        """Stop the server (a no-op once it has exited); its rank processes are stopped whether
        or not its thread ends in time."""
        handle = self.state.client.handle
        self.server.should_exit = True
        self.thread.join(60)
        stuck = self.thread.is_alive()
        if stuck:
            self.server.force_exit = True
            handle.shutdown(timeout_s=5.0)
        assert not stuck, "the server thread did not stop"
        assert not any(p.is_alive() for p in handle.procs), (
            "engine rank processes outlived the server")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(start_timeout_s: float = 180.0, **overrides) -> RunningServer:
    engine = EngineConfig(**(ENGINE | overrides.pop("engine", {})))
    if "batch_dir" not in overrides:  # its own Batch API store (the default one is the user's)
        overrides["batch_dir"] = tempfile.mkdtemp(prefix="compiled-engine-test-batches-")
        atexit.register(shutil.rmtree, overrides["batch_dir"], True)
    # bound now and handed to uvicorn: the engine's ranks start first and bind ports of their own,
    # which could take a port picked but not yet bound
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(ServerConfig(engine=engine, **overrides))
    server = Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
        ),
        announce=False,
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive(), "the server failed to start (see the log)"
        if time.monotonic() >= deadline:
            server.should_exit = True  # it stops as soon as its start-up ends
            raise AssertionError("the server did not start in time")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", server, thread)



@contextmanager
def servers(*overrides: dict) -> Iterator[list[RunningServer]]:
    """A server per `start_server` overrides, every one started stopped when the block ends (one
    that fails to start included)."""
    made: list[RunningServer] = []
    try:
        for o in overrides:
            made.append(start_server(**o))
        yield made
    finally:
        for running in made:
            running.stop()


def wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> dict:
    """Poll /debug/integrity until nothing is in flight; returns the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = http.get("/debug/integrity").json()
        if stats["idle"] and stats["server_in_flight"] == 0 and stats["num_running"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.05)


def assert_kv_all_free(stats: dict) -> None:
    assert stats["integrity_error"] is None, stats["integrity_error"]
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["total_pages"], stats


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (each event is `data: ...` + blank
    line)."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"an SSE event must end with a blank line, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"unexpected SSE line {line!r}"
        events.append(line[len("data: "):])
        expect_blank = True
    return events


def slow_schema(properties: int, tag: str = "") -> str:
    """An object schema whose compile takes seconds (each property's pattern is its own automaton
    over the whole vocabulary); `tag` makes its text unique (no cache has it)."""
    return json.dumps({
        "type": "object",
        "properties": {f"p{i}{tag}": {"type": "string", "pattern": "[a-z]{1,20}"}
                       for i in range(properties)},
        "required": [f"p{i}{tag}" for i in range(properties)],
    })
