"""Two engine ranks (gloo, overlap on) answer exactly as one rank does (the cross-rank ledger digest
is checked at every step). Rank failures: tests/distributed/test_rank_failure.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.servers import RunningServer, start_server


@pytest.fixture(scope="module")
def tp2() -> Iterator[RunningServer]:
    running = start_server(
        engine={
            "tp_size": 2,
            "num_pages": 2048,
            "max_running": 8,
            "tp_debug": True,
            "overlap": True,
        }
    )
    yield running
    running.stop()


def test_tp2_greedy_equals_tp1_and_streams(tp2: RunningServer, http: httpx.Client) -> None:
    body = {"sampling_params": {"max_tokens": 10, "temperature": 0, "ignore_eos": True}}
    with tp2.http() as client:
        for prompt in ("Hello world", "def fib(n):"):
            one = http.post("/generate", json=body | {"text": prompt}).json()["output_ids"]
            two = client.post("/generate", json=body | {"text": prompt}).json()["output_ids"]
            assert two == one
        out = client.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 4, "n": 3, "ignore_eos": True, "seed": 1},
        ).json()
        assert out["usage"]["completion_tokens"] == 12
        assert client.get("/health").json() == {"status": "ok"}


def test_tp2_prompt_logprobs_and_embeddings_equal_tp1(
    tp2: RunningServer, http: httpx.Client
) -> None:
    """The prompt's log-probs (vocabulary gathered across ranks) and the pooled hidden states (the
    same on every rank) of two ranks: one rank's, up to fp32 summation order."""
    body = {"input_ids": [1, 300, 301, 302, 77, 9, 4000],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "prompt_logprobs": 2}}
    embed = {"model": "demo", "input": ["Hello world", "def fib(n):"]}
    with tp2.http() as client:
        one = http.post("/generate", json=body).json()["prompt_logprobs"]
        two = client.post("/generate", json=body).json()["prompt_logprobs"]
        assert one[0] is None and two[0] is None and len(one) == len(two) == 7
        for a, b in zip(one[1:], two[1:], strict=True):
            assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4)
            assert b["rank"] == a["rank"]
        vectors = [c.post("/v1/embeddings", json=embed).json()["data"] for c in (http, client)]
        for a, b in zip(*vectors, strict=True):
            assert b["embedding"] == pytest.approx(a["embedding"], abs=1e-5)


def test_tp2_ranks_listen_on_loopback_only(tp2: RunningServer) -> None:
    """One host's ranks meet in a file and gloo binds loopback: no rank listens on another address
    (a TCP store would listen on every interface)."""
    import ipaddress

    import psutil

    for proc in tp2.state.client.handle.procs:
        conns = psutil.Process(proc.pid).net_connections("inet")
        listening = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
        assert listening, "gloo listens for its peer"
        assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback
                   for ip in listening), listening
