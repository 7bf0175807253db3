"""Each way an HTTP request ends leaves nothing behind, in the server or the engine: finished
(length), stopped by a stop string (n=2, one choice stopped), failed (a constraint no token can
continue), rejected by the engine (a constraint it cannot compile: a 400), and the client gone
mid-stream. One check after each, over every registry that remains: the server's routing entries
(`EngineClient.num_in_flight`), the rank's queues (waiting, running, in flight) and its page books
(integrity, every page free or cached)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.servers import assert_kv_all_free, wait_idle

pytestmark = pytest.mark.slow


def _assert_nothing_left(http: httpx.Client) -> None:
    stats = wait_idle(http)  # idle, nothing running, no routing entry in the server
    assert (
        stats["num_waiting"] == 0 and stats["num_running"] == 0 and stats["server_in_flight"] == 0
    ), stats
    assert_kv_all_free(stats)


def _complete(http: httpx.Client, **body) -> httpx.Response:
    return http.post(
        "/v1/completions", json={"model": "demo", "prompt": "a story", "temperature": 0, **body}
    )


def test_finished(http: httpx.Client) -> None:
    r = _complete(http, max_tokens=5, ignore_eos=True, n=2)
    assert r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == [
        "length",
        "length",
    ]
    _assert_nothing_left(http)


def test_stopped_by_a_stop_string(http: httpx.Client) -> None:
    whole = _complete(http, max_tokens=8, ignore_eos=True).json()["choices"][0]["text"]
    stop = whole[len(whole) // 2:][:2]
    assert stop.strip(), whole
    r = _complete(http, max_tokens=64, ignore_eos=True, stop=[stop], n=2)
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop", "stop"], r.json()
    _assert_nothing_left(http)


def test_failed(http: httpx.Client) -> None:
    stuck = {"json": {"type": "string", "pattern": "^a\u0001b$"}}  # no token continues '"a'
    r = _complete(http, max_tokens=16, structured_outputs=stuck)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "error", r.text
    _assert_nothing_left(http)


def test_rejected_by_the_engine(http: httpx.Client) -> None:
    r = _complete(http, max_tokens=4, n=2, structured_outputs={"regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    _assert_nothing_left(http)


def test_client_gone_mid_stream(server, http: httpx.Client) -> None:
    body = {
        "model": "demo",
        "prompt": "a long story",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }
    with server.http() as other, other.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    _assert_nothing_left(http)
