"""A TP rank that dies fails the server with a clear reason in bounded time: in-flight requests get
the error, the server exits, and no rank process is left behind. (A hung rank:
test_tp_parity.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.helpers.servers import start_server

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def test_killing_rank_1_fails_requests_and_ends_the_server() -> None:
    running = start_server(
        engine=dict(tp_size=2, num_pages=4096, max_running=8), engine_dead_exit_s=3.0
    )
    try:
        procs = list(running.state.client.handle.procs)
        blocking: dict = {}

        def non_streaming() -> None:
            with running.http() as client:
                blocking["response"] = client.post("/v1/completions", json=LONG)

        other = threading.Thread(target=non_streaming)
        other.start()
        with (
            running.http() as client,
            client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # a first token: the engine is generating
            os.kill(procs[1].pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        errors = [json.loads(x[6:])["error"]["message"] for x in rest if '"error"' in x]
        assert errors and "engine rank 1" in errors[0] and "SIGKILL" in errors[0], rest[-3:]
        assert rest[-1] == "data: [DONE]"
        other.join(30)
        assert blocking["response"].status_code == 503
        assert "engine rank 1" in blocking["response"].json()["error"]["message"]
        with running.http() as client:
            health = client.get("/health")
        assert health.status_code == 503 and "engine rank 1" in health.json()["reason"]
        running.thread.join(30)
        assert not running.thread.is_alive(), "the server should exit once its engine is gone"
        assert running.server.engine_dead_since is not None
        assert not any(p.is_alive() for p in procs), "engine rank processes outlived the failure"
        with pytest.raises(httpx.ConnectError):
            httpx.get(running.url + "/health", timeout=2)
    finally:
        running.stop()  # a no-op once it has exited
