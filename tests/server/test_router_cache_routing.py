"""Cache-aware routing pays: a multi-tenant workload (8 system prompts x 8 questions, shuffled,
4 concurrent clients) through each router, replicas whose KV pool holds about 6 of the 8 system
prompts. `cache_aware` keeps each tenant on one replica, so each replica's cache holds its tenants;
`round_robin` sends every tenant everywhere and the caches thrash. The hit rate is what the
replicas' own `/metrics` count (`vllm:prefix_cache_hits_total / ..._queries_total`, prompt tokens).
And `vllm-router --policy kv_aware` routes on the replicas' published KV events.

The replicas serve every run of the module: each run has its own tenants (a seed each), and the
prefix cache evicts least recently used first, so what an earlier run left in the pool goes before
anything of the current run: a run sees what a fresh pool would give it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import ExitStack
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
from tests.helpers.servers import RunningServer, servers

pytestmark = pytest.mark.slow


def hit_rate(replicas: list[RunningServer], url: str, seed: int) -> float:
    """The workload (8 x 8, tenants drawn from `seed`; system prompts of about 1350 tokens: 8192
    pages of one token hold about 6) from 4 concurrent clients (the routers balance on their
    requests in flight: one at a time, every new tenant would go to their first replica); the
    replicas' hit rate."""
    run = run_workload(url, tenant_workload(8, 8, 500, seed, "demo"), [r.url for r in replicas], 4)
    print("prompt tokens looked up per replica:", run["tokens_looked_up_per_replica"])
    return run["hit_rate"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RunningServer]]:
    with servers({}, {}) as made:
        yield made


@pytest.fixture(scope="module")
def alone(replicas: list[RunningServer]) -> float:
    """One of the replicas by itself, no router."""
    return hit_rate(replicas[:1], replicas[0].url, seed=0)


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_cache_aware_routing_beats_round_robin_on_prefix_hits(
    kind: str, alone: float, replicas: list[RunningServer], tmp_path: Path
) -> None:
    rates = {}
    for i, policy in enumerate(("cache_aware", "round_robin")):
        seed = 1 + 2 * sorted(ROUTERS).index(kind) + i  # a run's own tenants (alone's: 0)
        with running_router(
            kind, policy, [r.url for r in replicas], tmp_path / f"{policy}.log"
        ) as url:
            rates[policy] = hit_rate(replicas, url, seed)
    print(f"{kind}: prefix hit rate alone {alone:.3f}, {rates}")
    # A tenant's first question misses wherever it goes: kept on one replica, 7 of its 8 hit (0.87,
    # every run so far; a 6 / 2 split of the tenants would fill one pool and lose a little). Round
    # robin sends each tenant to both replicas, so 2 of its 8 miss before any eviction: at most
    # 0.75, under 0.87 - 0.1 (seen: 0.56-0.70). Alone keeps 7 of 8 only if its pool held all 8
    # tenants; it holds about 6 (seen: 0.54-0.67)
    assert rates["cache_aware"] >= alone + 0.1
    assert rates["cache_aware"] >= rates["round_robin"] + 0.1


@pytest.fixture(scope="module")
def kv_routers(tmp_path_factory) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Two replicas publishing their KV events, and a `vllm-router --policy kv_aware` over them per
    way of finding the events (`/kv_event_sources` or flags): (replica URLs, sources -> router URL).
    The routers start before any prompt: a router started later skips the stores of every prompt
    that extends a page cached before it came (here the BOS page: "unknown parent; skipping
    unanchored store"), so it could not follow them."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    logs = tmp_path_factory.mktemp("kv_routers")
    with servers(*({"engine": {"kv_events": {"enable_kv_cache_events": True, "endpoint": ep}}}
                   for ep in endpoints)) as made, ExitStack() as stack:
        urls = [r.url for r in made]
        static = (*(x for url, ep in zip(urls, endpoints, strict=True)
                    for x in ("--kv-event-source", f"{url}={ep}")),
                  "--kv-event-block-size", "1", "--kv-event-model", "demo")
        yield urls, {
            sources: stack.enter_context(
                running_router("vllm", "kv_aware", urls, logs / f"{sources}.log", extra))
            for sources, extra in (("discovered", ()), ("static", static))
        }


@pytest.mark.parametrize("sources", ["discovered", "static"])
def test_vllm_router_kv_aware_follows_the_published_kv_events(
    sources: str, kv_routers: tuple[list[str], dict[str, str]]
) -> None:
    """`vllm-router --policy kv_aware` subscribed to both replicas' KV events (found through
    `/get_server_info` and `/kv_event_sources`, or given by flags): a prompt cached on one replica
    (sent to it directly) draws every later request that shares its prefix there."""
    urls, routers = kv_routers
    rng = random.Random(sources)  # prefixes that the other case did not cache
    for target in (1, 0, 1):
        prefix = " ".join(rng.choice(WORDS) for _ in range(200))
        warm = {"model": "demo", "prompt": prefix, "max_tokens": 1, "temperature": 0}
        assert httpx.post(urls[target] + "/v1/completions", json=warm,
                          timeout=60).status_code == 200
        time.sleep(1.0)  # the events reach the router
        before = [prefix_counts(u) for u in urls]
        for q in range(4):
            body = warm | {"prompt": f"{prefix} and question {q}"}
            r = httpx.post(routers[sources] + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        after = [prefix_counts(u) for u in urls]
        queried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        hits = after[target][0] - before[target][0]
        assert queried[1 - target] == 0, (target, queried)
        assert hits >= 0.8 * queried[target], (hits, queried)  # the prefix was reused
