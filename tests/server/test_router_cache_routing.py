"""Cache-aware routing pays: a multi-tenant workload (8 system prompts x 16 questions, shuffled,
4 concurrent clients) through each router, replicas whose KV pool holds about 6 of the 8 system
prompts. `cache_aware` keeps each tenant on one replica, so each replica's cache holds its tenants;
`round_robin` sends every tenant everywhere and the caches thrash. The hit rate is what the
replicas' own `/metrics` count (`vllm:prefix_cache_hits_total / ..._queries_total`, prompt tokens).
And `vllm-router --policy kv_aware` routes on the replicas' published KV events."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from benchmarks.router import (
    ROUTERS,
    WORDS,
    prefix_counts,
    run_workload,
    running_router,
    tenant_workload,
)
from compiled_engine.ranks.launcher import free_port
from tests.helpers.servers import RunningServer, start_server

pytestmark = pytest.mark.slow


def hit_rate(replicas: list[RunningServer], url: str) -> float:
    """The workload (8 x 16; system prompts of about 1350 tokens: 8192 pages of one token hold
    about 6) from 4 concurrent clients (the routers balance on their requests in flight: one at a
    time, every new tenant would go to their first replica); the replicas' hit rate."""
    run = run_workload(url, tenant_workload(8, 16, 500, 0, "demo"), [r.url for r in replicas], 4)
    print("prompt tokens looked up per replica:", run["tokens_looked_up_per_replica"])
    return run["hit_rate"]


@contextmanager
def fresh_replicas(n: int) -> Iterator[list[RunningServer]]:
    made = [start_server() for _ in range(n)]
    try:
        yield made
    finally:
        for running in made:
            running.stop()


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
        with fresh_replicas(2) as replicas, running_router(
            kind, policy, [r.url for r in replicas], tmp_path / f"{policy}.log"
        ) as url:
            rates[policy] = hit_rate(replicas, url)
    print(f"{kind}: prefix hit rate alone {alone:.3f}, {rates}")
    # Balanced tenants (4 / 4) give ~0.93; the routers' load balancing may split them 6 / 2 (seen:
    # ~0.86); a tenant's first question misses wherever it goes
    assert rates["cache_aware"] >= alone + 0.1
    assert rates["cache_aware"] >= rates["round_robin"] + 0.1


@pytest.mark.parametrize("sources", ["discovered", "static"])
def test_vllm_router_kv_aware_follows_the_published_kv_events(sources: str, tmp_path: Path) -> None:
    """`vllm-router --policy kv_aware` subscribed to both replicas' KV events (found through
    `/get_server_info` and `/kv_event_sources`, or given by flags): a prompt cached on one replica
    (sent to it directly) draws every later request that shares its prefix there."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    made = [
        start_server(engine={"kv_events": {"enable_kv_cache_events": True, "endpoint": ep}})
        for ep in endpoints
    ]
    urls = [r.url for r in made]
    extra: tuple[str, ...] = ()
    if sources == "static":
        extra = (*(x for url, ep in zip(urls, endpoints, strict=True)
                   for x in ("--kv-event-source", f"{url}={ep}")),
                 "--kv-event-block-size", "1", "--kv-event-model", "demo")
    rng = random.Random(1)
    try:
        with running_router("vllm", "kv_aware", urls, tmp_path / "router.log", extra) as url:
            for target in (1, 0, 1):
                prefix = " ".join(rng.choice(WORDS) for _ in range(200))
                warm = {"model": "demo", "prompt": prefix, "max_tokens": 1, "temperature": 0}
                assert httpx.post(urls[target] + "/v1/completions", json=warm,
                                  timeout=60).status_code == 200
                time.sleep(1.0)  # the events reach the router
                before = [prefix_counts(u) for u in urls]
                for q in range(4):
                    body = warm | {"prompt": f"{prefix} and question {q}"}
                    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                    assert r.status_code == 200, r.text
                after = [prefix_counts(u) for u in urls]
                queried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
                hits = after[target][0] - before[target][0]
                assert queried[1 - target] == 0, (target, queried)
                assert hits >= 0.8 * queried[target], (hits, queried)  # the prefix was reused
    finally:
        for r in made:
            r.stop()
