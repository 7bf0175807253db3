"""Hostile input through the served default (compiled demo model): while each hostile request
runs, a probe keeps calling a route that needs no engine work and every answer comes within 5 s
(a stall is the hostile work's length, seconds to minutes; the margin is for a loaded machine);
the hostile request gets a 4xx in OpenAI's shape (or a plain answer); the server serves normally
afterwards. Also: stalled readers, SIGTERM's drain, browser-origin requests, oversized answers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers.servers import (
    RunningServer,
    assert_kv_all_free,
    slow_schema,
    start_server,
    wait_idle,
)

PROBE_LIMIT_S = 5.0
# what the process family may grow by while it refuses an oversized answer (the answer itself would
# take more)
MEMORY_GROWTH_LIMIT = 128 * 2**20


@contextlib.contextmanager
def probing(server: RunningServer) -> Iterator[list[float]]:
    """GET /v1/models in a loop (at most 600 calls, 120 s) from before the block starts until it
    ends; yields the latencies, checked after it."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with server.http() as client:
            deadline = time.monotonic() + 120
            while not stop.is_set() and len(latencies) < 600 and time.monotonic() < deadline:
                t0 = time.monotonic()
                assert client.get("/v1/models").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.05)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not latencies and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # the probe is answering before the hostile request goes out
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(60)
    assert latencies, "the probe never got an answer"
    assert max(latencies) < PROBE_LIMIT_S, f"the probe waited {max(latencies):.2f} s"


def _assert_openai_error(response: httpx.Response, status: int, param_prefix: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param_prefix), error
    return error


def _serves_normally(server: RunningServer, http: httpx.Client) -> None:
    out = http.post("/v1/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 4,
                                             "temperature": 0})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
    assert_kv_all_free(wait_idle(http))


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_a_backtracking_pattern_runs_in_linear_time(server: RunningServer, http) -> None:
    """A forced call whose argument would take Python's `re` hours against `^(a+)+$`: validated in
    RE2, it is not a call (its argument does not match), the answer stays content."""
    hostile = "a" * 40 + "b"
    call = f'<tool_call>\n{{"name": "f", "arguments": {{"s": "{hostile}"}}}}\n</tool_call>'
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "temperature": 0, "tool_choice": "auto",
            "tools": _tool({"type": "object", "properties": {"s": {"type": "string",
                                                                   "pattern": "^(a+)+$"}}}),
            "structured_outputs": {"choice": [call]}}
    with probing(server):
        out = http.post("/v1/chat/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    message = out.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and hostile in message["content"]
    _serves_normally(server, http)


@pytest.mark.parametrize(("parameters", "message"), [
    ({"$ref": "#"}, "leads back into itself"),
    ({"$defs": {"n": {"properties": {"n": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     "leads back into itself"),
    (json.loads('{"type": "object", "properties": {"a": ' * 200 + '{}' + "}}" * 200),
     "nested deeper than"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(x)\\1"}}},
     "not a pattern this server evaluates"),
])
def test_recursive_deep_and_unsupported_schemas_are_400s(server: RunningServer, http, parameters,
                                                        message) -> None:
    with probing(server):
        for route, body in [
            ("/v1/chat/completions", {"tools": _tool(parameters), "tool_choice": "auto"}),
            ("/v1/chat/completions", {"response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": parameters}}}),
        ]:
            out = http.post(route, json={"model": "demo", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}], **body})
            error = _assert_openai_error(out, 400, "tools[0]" if "tools" in body else
                                         "response_format")
            assert message in error["message"]
        out = http.post("/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 4, "json_schema": json.dumps(parameters)}})
        assert message in _assert_openai_error(out, 400, "sampling_params.json_schema")["message"]
    _serves_normally(server, http)


def test_a_regex_constraint_outside_re2_is_a_400(server: RunningServer, http) -> None:
    out = http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 4,
                                             "structured_outputs": {"regex": "(?<=a)b"}})
    _assert_openai_error(out, 400, "structured_outputs.regex")
    out = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4,
                                                                         "regex": "(a)\\1"}})
    _assert_openai_error(out, 400, "sampling_params.regex")


def _schema_format(schema: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(schema)}}


def test_a_grammar_compiles_outside_the_engine_steps(server: RunningServer, http) -> None:
    """A constraint that takes seconds to compile: once the server's check has passed it, the rank
    compiles it again while the request waits outside the steps, and another request's steps run
    meanwhile (the engine's step counter moves on between two reads that both see the constrained
    request waiting for its grammar)."""
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2,
            "response_format": _schema_format(slow_schema(800, "steps"))}
    got: dict = {}
    slow = threading.Thread(target=lambda: got.update(out=server.http().post(
        "/v1/completions", json=body, timeout=120)), daemon=True)
    other = threading.Thread(target=lambda: got.update(other=server.http().post(
        "/v1/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 1500,
                                 "ignore_eos": True}, timeout=120)), daemon=True)
    with probing(server):
        slow.start()
        deadline = time.monotonic() + 120
        while http.get("/debug/integrity").json()["num_waiting_grammar"] == 0:
            assert slow.is_alive() and time.monotonic() < deadline, got
            time.sleep(0.02)
        other.start()
        waiting_steps = []  # the step counter at each read that sees the request waiting
        while other.is_alive() and len(waiting_steps) < 2000:
            stats = http.get("/debug/integrity").json()
            if stats["num_waiting_grammar"] == 1:
                assert stats["num_waiting"] >= 1
                waiting_steps.append(stats["steps"])
            time.sleep(0.05)
        slow.join(120)
        other.join(120)
    assert got["other"].status_code == 200
    assert got["other"].json()["usage"]["completion_tokens"] == 1500
    assert len(waiting_steps) >= 2 and waiting_steps[-1] > waiting_steps[0], waiting_steps
    assert got["out"].status_code == 200, got["out"].text
    assert got["out"].json()["choices"][0]["finish_reason"] == "length"
    _serves_normally(server, http)


@pytest.mark.parametrize(("headers", "status"), [
    ({"content-type": "text/plain"}, 415),  # a cross-site fetch with no preflight
    ({"content-type": "application/x-www-form-urlencoded"}, 415),  # a cross-site form
    ({"content-type": "multipart/form-data; boundary=x"}, 415),
    ({}, 415),
    ({"content-type": "application/json; charset=utf-8"}, 200),
    ({"content-type": "application/vnd.api+json"}, 200),
])
def test_a_post_body_must_be_json(server: RunningServer, http, headers, status) -> None:
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 2})
    out = http.post("/v1/completions", content=body, headers=headers)
    assert out.status_code == status, out.text
    if status != 200:
        error = out.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize(("host", "status"), [
    ("evil.test", 421),  # a rebound name: DNS points it at 127.0.0.1, the browser sends it
    ("evil.test:8000", 421),
    ("127.0.0.1.evil.test", 421),
    ("10.0.0.5", 421),
    ("localhost", 200),
    ("app.localhost:1234", 200),
    ("127.0.0.1", 200),
    ("127.1.2.3:80", 200),
    ("[::1]:8000", 200),
])
def test_a_loopback_server_answers_loopback_hosts_only(server: RunningServer, http, host,
                                                        status) -> None:
    for method, path, kwargs in [("GET", "/v1/models", {}), ("GET", "/", {}),
                                 ("POST", "/tokenize", {"json": {"prompt": "hi"}})]:
        out = http.request(method, path, headers={"host": host}, **kwargs)
        assert out.status_code == status, (path, out.text)
        if status != 200:
            error = out.json()["error"]
            assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]


SEND_TIMEOUT_S = 2.0
STALL_WAIT_S = 600.0


@pytest.fixture(scope="module")
def quick_drop() -> Iterator[RunningServer]:
    """The default server with a short send timeout (60 s by default), so a test sees the drop."""
    running = start_server(debug=True, send_timeout_s=SEND_TIMEOUT_S)
    yield running
    running.stop()


def test_a_client_that_stops_reading_is_dropped(quick_drop: RunningServer) -> None:
    """8 streams with 20 log-probs a token, never read: the server's writes stall, and within the
    send timeout (plus the engine's abort) the requests are gone, their pages free, the connection
    closed with the answer cut short; others are served all along."""
    port = int(quick_drop.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True,
                       "stream": True, "n": 8, "logprobs": 20})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        sock.settimeout(120)
        received = b""
        while len(received) < 12:  # the status line: the streams have their first tokens
            chunk = sock.recv(12 - len(received))
            assert chunk, "the server closed the connection before answering"
            received += chunk
        with quick_drop.http() as http, probing(quick_drop):
            # the writes stall once the socket buffers hold their bytes (a few MB: a part of the
            # streams' 1,500 steps, however fast they come), then the streams go
            assert_kv_all_free(wait_idle(http, timeout_s=STALL_WAIT_S))
            out = http.post("/v1/completions", json={"model": "demo", "prompt": "hello",
                                                     "max_tokens": 4, "temperature": 0})
            assert out.status_code == 200
        sock.settimeout(30)
        while chunk := sock.recv(1 << 16):  # what the kernel buffered, then the server's close
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        sock.close()


class _Stream(threading.Thread):
    """A streamed completion read on its own thread; `started` is set at its first event (or its
    end, when it has none)."""

    def __init__(self, server: RunningServer, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.started = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []
        self.start()

    def run(self) -> None:
        try:
            with (self.server.http() as client,
                  client.stream("POST", "/v1/completions", json=self.body) as r):
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        finally:
            self.started.set()


DRAIN_S = 600.0  # run out by the test itself
SHORT_TOKENS = 200
LONG_TOKENS = 2000  # (the demo's context is 2,048)
STREAM_WAIT_S = 120.0


@pytest.fixture
def draining() -> Iterator[RunningServer]:
    """A server of the test's own (the test signals it); stopped however the test ends."""
    with start_server(shutdown_timeout_s=DRAIN_S) as running:
        yield running


def test_sigterm_drains_then_exits(draining: RunningServer) -> None:
    """The first SIGTERM: /health 503, new requests 503, the streams in flight finish with their
    finish_reason and [DONE]; one still running when --shutdown-timeout runs out ends with an error
    event and [DONE]; then the server exits and its rank processes with it.

    Nothing here races the machine's speed: the signal goes once every stream has its first event
    (each waits for it, bounded), so all are in flight; the drain's time (600 s) outlasts the short
    streams (200 tokens each), and once they have ended the test runs the drain's time out itself
    (the long stream, 4 x 2,000 tokens, has 1,800 steps left then, on any machine)."""
    running = draining
    procs = list(running.state.client.handle.procs)
    base = {"model": "demo", "prompt": "hi", "stream": True, "ignore_eos": True, "temperature": 0}
    long = _Stream(running, base | {"max_tokens": LONG_TOKENS, "n": 4})
    assert long.started.wait(STREAM_WAIT_S), "the long stream never started"
    shorts = [_Stream(running, base | {"max_tokens": SHORT_TOKENS}) for _ in range(3)]
    for short in shorts:
        assert short.started.wait(STREAM_WAIT_S), "a short stream never started"
    assert long.is_alive() and long.status == 200, (long.status, long.lines[-2:])
    with running.http() as http:
        running.server.handle_exit(signal.SIGTERM, None)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = http.post("/v1/completions",
                            json={"model": "demo", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for short in shorts:
        short.join(STREAM_WAIT_S)
        assert not short.is_alive(), "a short stream did not end in the drain"
    assert long.is_alive(), "the long stream ended before the drain's time ran out"
    state = running.state
    state.config = dataclasses.replace(state.config, shutdown_timeout_s=0.0)  # time is up now
    long.join(STREAM_WAIT_S)
    assert not long.is_alive(), "the long stream did not end when the drain's time ran out"
    for short in shorts:
        assert short.status == 200 and short.lines[-1] == "data: [DONE]"
        assert json.loads(short.lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert long.status == 200 and long.lines[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(long.lines[-2][6:])["error"]["message"]
    running.thread.join(60)
    assert not running.thread.is_alive(), "the server did not exit after the drain"
    assert not any(p.is_alive() for p in procs)


@contextlib.contextmanager
def family_memory(server: RunningServer) -> Iterator[list[int]]:
    """The resident bytes of the process family (this process, which serves, and the engine's rank
    processes) every 20 ms while the block runs (at most 3,000 samples); yields them, the first
    taken before the block starts."""
    procs = [psutil.Process(), *(psutil.Process(p.pid) for p in server.state.client.handle.procs)]
    samples = [sum(p.memory_info().rss for p in procs)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02) and len(samples) < 3000:
            samples.append(sum(p.memory_info().rss for p in procs))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(10)


def test_an_oversized_answer_is_refused_up_front(server: RunningServer, http) -> None:
    """64 prompts of 1,000 tokens with 20 alternatives per prompt token: over a million log-probs
    (tens of MB as JSON, more as Python objects), a 400 that says the limit before any work, the
    process family's memory about flat meanwhile; the same request with 2 alternatives runs."""
    prompts = [[(7 * i + j) % 900 + 10 for j in range(1000)] for i in range(64)]
    body = {"model": "demo", "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
    with probing(server), family_memory(server) as rss:
        out = http.post("/v1/completions", json=body)
    assert max(rss) - rss[0] < MEMORY_GROWTH_LIMIT, f"{(max(rss) - rss[0]) / 2**20:.0f} MiB more"
    error = _assert_openai_error(out, 400, "prompt_logprobs")
    assert "limit of 1,048,576" in error["message"]
    assert http.post("/v1/completions", json=body | {"prompt": prompts[:4],
                                                     "prompt_logprobs": 2}).status_code == 200
    _serves_normally(server, http)


def test_a_large_input_is_tokenized_off_the_event_loop(server: RunningServer, http) -> None:
    """3.6 MB of text (about 2 s of tokenizing, 1.9 million tokens) through /tokenize, the chat
    template and a completion that is refused as too long: the probe is answered all along."""
    text = " ".join(f"word{i % 5000}" for i in range(400_000))
    with probing(server):
        plain = http.post("/tokenize", json={"prompt": text})
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
        long = http.post("/v1/completions", json={"model": "demo", "prompt": text, "max_tokens": 1})
    assert plain.status_code == 200 and plain.json()["count"] > 1_000_000
    assert chat.status_code == 200 and chat.json()["count"] > plain.json()["count"]
    _assert_openai_error(long, 400, "")


def test_stop_lists_are_bounded(server: RunningServer, http) -> None:
    """At most 16 stop strings of at most 256 characters (each one is held back and scanned at
    every token): more is a 400 naming 'stop'; within them, a stop string ends the answer."""
    base = {"model": "demo", "prompt": "hi", "max_tokens": 8, "temperature": 0}
    for stop in (["x"] * 17, ["y" * 257], "z" * 5000):
        _assert_openai_error(http.post("/v1/completions", json=base | {"stop": stop}), 400, "stop")
    plain = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    cut = http.post("/v1/completions", json=base | {"stop": ["q" * 256, plain[2:4]]}).json()
    assert cut["choices"][0]["text"] == plain[:plain.index(plain[2:4])]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def timeouts() -> Iterator[RunningServer]:
    """The default server with short read, request and grammar compile timeouts (60 s, none and
    10 s by default)."""
    running = start_server(debug=True, read_timeout_s=1.0, request_timeout_s=1.0,
                           grammar_compile_timeout_s=0.5)
    yield running
    running.stop()


def test_a_slow_upload_is_cut_with_a_408(timeouts: RunningServer) -> None:
    port = int(timeouts.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)  # (the rest of the body never comes)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_generation_past_the_request_timeout_ends(timeouts: RunningServer) -> None:
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "n": 3}
    with timeouts.http() as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 408 and whole.json()["error"]["code"] == "request_timeout"
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "--request-timeout" in error["message"] and error["type"] == "invalid_request_error"
        assert_kv_all_free(wait_idle(http))
        short = http.post("/v1/completions", json=body | {"max_tokens": 4, "n": 1})
        assert short.status_code == 200


def test_a_grammar_past_its_compile_budget_is_a_400(timeouts: RunningServer) -> None:
    """A schema whose compile takes seconds, against a 0.5 s budget: a 400 naming the field and the
    flag (streamed or not, and again from the cache); the engine never saw it (it took no step)
    and serves on. (The worker's restart: test_grammar_check.py.)"""
    body = {"model": "demo", "prompt": "hi", "max_tokens": 4,
            "response_format": _schema_format(slow_schema(800, "budget"))}
    with timeouts.http() as http, probing(timeouts):
        steps = wait_idle(http)["steps"]
        for extra in ({}, {"stream": True}):
            out = http.post("/v1/completions", json=body | extra)
            error = _assert_openai_error(out, 400, "response_format")
            assert "--grammar-compile-timeout" in error["message"]
        assert wait_idle(http)["steps"] == steps  # the engine never had it
        ok = http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        assert_kv_all_free(wait_idle(http))
