"""A server with an API key, one sequence in flight at most and a small body limit; then its engine
dies."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from server.args import resolve_api_keys
from tests.helpers.servers import RunningServer, start_server

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def limited() -> Iterator[RunningServer]:
    running = start_server(api_keys=(KEY,), max_queue=1, max_body_bytes=2048,
                           allowed_hosts=("API.internal:8000",))  # (its port and case ignored)
    yield running
    running.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_an_api_key_file_takes_one_key_a_line_without_comments_or_blanks(tmp_path) -> None:
    """A comment or a blank line in --api-key-file was taken as a key (any client sending
    "# keys" got in)."""
    path = tmp_path / "keys"
    path.write_text("# the team's keys\n\nalpha\n  beta  \n#gamma\nalpha\n")
    assert resolve_api_keys(argparse.Namespace(api_key_file=str(path), api_key=None)) == (
        "alpha", "beta")
    path.write_text("# none yet\n\n")
    with pytest.raises(OSError, match="holds no key"):
        resolve_api_keys(argparse.Namespace(api_key_file=str(path), api_key=None))


def test_api_key_required_except_health(limited: RunningServer) -> None:
    with limited.http() as http:
        assert http.get("/health").status_code == 200
        body = {"prompt": "hi", "max_tokens": 2}
        err = _error(http.post("/v1/completions", json=body), 401)
        # OpenAI's shape
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        _error(
            http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401
        )
        _error(http.get("/v1/models"), 401)
        _error(http.get("/metrics"), 401)
        assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        assert http.get("/v1/models", headers=AUTH).status_code == 200
        # --allowed-hosts: that name too, besides loopback ones; others refused before the key
        assert http.get("/v1/models", headers=AUTH | {"host": "api.internal:80"}).status_code == 200
        assert _error(http.get("/health", headers={"host": "evil.test"}), 421)["code"] == \
            "host_not_allowed"


def test_body_too_large_is_413(limited: RunningServer) -> None:
    with limited.http(headers=AUTH) as http:
        err = _error(
            http.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1}), 413
        )
        assert "2048 bytes" in err["message"]

        def chunks():  # no content-length: the limit holds while reading
            for _ in range(10):
                yield b" " * 1000

        _error(http.post("/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"}), 413)


def test_overload_is_429_and_clears(limited: RunningServer) -> None:
    body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with limited.http(headers=AUTH) as a, limited.http(headers=AUTH) as b:
        with a.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # keep it referenced: dropping the iterator closes the connection
            lines = r.iter_lines()
            next(lines)
            refused = b.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            err = _error(refused, 429)
            assert "overloaded" in err["message"] and "--max-queue" in err["message"]
            assert refused.headers["Retry-After"] == "1"
            # more sequences than the server ever runs at once: no retry helps, a 400
            never = b.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 2})
            err = _error(never, 400)
            assert "at most 1 at once (--max-queue)" in err["message"]
        deadline = time.monotonic() + 30
        while (
            r2 := b.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        ).status_code == 429:
            assert time.monotonic() < deadline, "the aborted stream never left the queue"
            time.sleep(0.05)
        assert r2.status_code == 200


def test_engine_death_fails_requests_and_health(limited: RunningServer) -> None:
    """Runs last in this module: kills the rank process under an in-flight stream."""
    body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with limited.http(headers=AUTH) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(limited.state.client.handle.procs[0].pid, signal.SIGKILL)
            rest = "\n".join(lines)  # must end, not hang
        assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert http.get("/health").status_code == 503
        err = _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 503)
        assert "engine" in err["message"]
