"""Cache-aware routing pays: a multi-tenant workload (8 system prompts x 16 questions, shuffled)
through each router, replicas whose KV pool holds about 6 of the 8 system prompts. `cache_aware`
keeps each tenant on one replica, so each replica's cache holds its tenants; `round_robin` sends
every tenant everywhere and the caches thrash. The hit rate is what the replicas' own `/metrics`
count (`vllm:prefix_cache_hits_total / ..._queries_total`, prompt tokens)."""

from __future__ import annotations

import random
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from compiled_engine.ranks.launcher import free_port
from tests.server.conftest import RunningServer, start_server
from tests.server.test_routers import ROUTERS

pytestmark = pytest.mark.slow

TENANTS, QUESTIONS = 8, 16
WORDS = ("river", "garden", "cloud", "engine", "paper", "silver", "window", "market", "forest",
         "signal", "harbor", "lantern")


def workload() -> list[dict]:
    """8 system prompts of about 1350 tokens each (8192 pages of one token hold about 6 of them
    beside what is running), 16 short questions each, in a seeded shuffled order."""
    rng = random.Random(0)
    systems = [" ".join(rng.choice(WORDS) for _ in range(500)) for _ in range(TENANTS)]
    bodies = [
        {"model": "demo", "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {q}: which word comes first?"}]}
        for system in systems for q in range(QUESTIONS)
    ]
    rng.shuffle(bodies)
    return bodies


def prefix_counts(replica: RunningServer) -> tuple[float, float]:
    text = httpx.get(replica.url + "/metrics", timeout=30).text
    hits, queries = (
        float(re.search(rf"^vllm:prefix_cache_{name}_total (\S+)$", text, re.M).group(1))
        for name in ("hits", "queries")
    )
    return hits, queries


def hit_rate(replicas: list[RunningServer], url: str) -> float:
    """Send the workload to `url` from 4 concurrent clients (the routers balance on their requests
    in flight: one request at a time, every new tenant would go to their first replica); the
    replicas' prompt-token hit rate."""
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(
            lambda body: client.post(url + "/v1/chat/completions", json=body), workload()))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:3]
    counts = [prefix_counts(r) for r in replicas]
    print("prompt tokens hit / looked up per replica:", counts)
    return sum(h for h, _ in counts) / sum(q for _, q in counts)


@contextmanager
def fresh_replicas(n: int) -> Iterator[list[RunningServer]]:
    made = [start_server() for _ in range(n)]
    try:
        yield made
    finally:
        for running in made:
            running.stop()


@contextmanager
def router(
    kind: str, policy: str, replicas: list, log: Path, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """`kind`'s router over `replicas` (anything with a `url`) on a free port, until the block
    ends."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*ROUTERS[kind], "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--policy", policy, "--worker-urls", *(r.url for r in replicas), *extra],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=10).is_success:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no router: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def alone() -> float:
    """One replica of the same size, no router."""
    with fresh_replicas(1) as (replica,):
        return hit_rate([replica], replica.url)


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_cache_aware_routing_beats_round_robin_on_prefix_hits(
    kind: str, alone: float, tmp_path: Path
) -> None:
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        with fresh_replicas(2) as replicas, router(
            kind, policy, replicas, tmp_path / f"{policy}.log"
        ) as url:
            rates[policy] = hit_rate(replicas, url)
    print(f"{kind}: prefix hit rate alone {alone:.3f}, {rates}")
    # a tenant's first question misses, wherever it goes; its system prompt is ~97% of a prompt
    assert rates["cache_aware"] >= alone + 0.15
    assert rates["cache_aware"] >= rates["round_robin"] + 0.15


def test_vllm_router_kv_aware_follows_the_published_kv_events(tmp_path: Path) -> None:
    """`vllm-router --policy kv_aware` subscribed to both replicas' KV events: a prompt cached on
    one replica (sent to it directly) draws every later request that shares its prefix there."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    made = [
        start_server(engine={"kv_events": {"enable_kv_cache_events": True, "endpoint": ep}})
        for ep in endpoints
    ]
    sources = [x for r, ep in zip(made, endpoints, strict=True)
               for x in ("--kv-event-source", f"{r.url}={ep}")]
    extra = (*sources, "--kv-event-block-size", "1", "--kv-event-model", "demo")
    rng = random.Random(1)
    try:
        with router("vllm", "kv_aware", made, tmp_path / "router.log", extra) as url:
            for target in (1, 0, 1):
                prefix = " ".join(rng.choice(WORDS) for _ in range(200))
                warm = {"model": "demo", "prompt": prefix, "max_tokens": 1, "temperature": 0}
                assert httpx.post(made[target].url + "/v1/completions", json=warm,
                                  timeout=60).status_code == 200
                time.sleep(0.5)  # the events reach the router
                before = [prefix_counts(r) for r in made]
                for q in range(4):
                    body = warm | {"prompt": f"{prefix} and question {q}"}
                    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                    assert r.status_code == 200, r.text
                after = [prefix_counts(r) for r in made]
                queried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
                hits = after[target][0] - before[target][0]
                assert queried[1 - target] == 0, (target, queried)
                assert hits >= 0.8 * queried[target], (hits, queried)  # the prefix was reused
    finally:
        for r in made:
            r.stop()
