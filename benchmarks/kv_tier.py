"""`bench tier`: the KV tier (prefix-cache pages on disk) against no tier, side by side in one
process.

  restart   a 2,000-token system prompt and a question: the time to the first token on an engine
            that has never seen it (a cold prefill) and on an engine restarted on the first one's
            `--kv-cache-dir` (its prefix from the tier), each round a fresh directory; the page
            files are in the OS's page cache, as on a server restarted on the same machine
  tenants   `tenants` system prompts whose tokens are 4x the KV pool, one request per tenant per
            pass, in turn: the pool evicts each tenant's prefix before its turn comes again. The
            second pass is timed on an engine with the tier and on one without: prompt tokens not
            prefilled (pool + tier hits) and requests per second (one request at a time, as the
            tenants' turns come)
  index     a store of `index_pages` small pages opened again: the seconds to rebuild its index
The best round of each is kept (the ratio of each round's pair for TTFT).
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import time
from collections.abc import Callable

from compiled_engine.kv_tier.store import PageStore
from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)
    return time.perf_counter() - t0


def _restart_round(model_dir: str, system: list[int], questions: list[list[int]],
                   settings: dict) -> tuple[float, float]:
    """(cold prefill, after a restart) seconds to the first token."""
    with tempfile.TemporaryDirectory() as kv_dir:
        first = LLM(model_dir, kv_cache_dir=kv_dir, **settings)
        _ttft(first, questions[0])  # warms the engine's own first-call costs
        cold = _ttft(first, system + questions[1])
        first.engine.shutdown()  # its writer has stored every page
        second = LLM(model_dir, kv_cache_dir=kv_dir, **settings)
        _ttft(second, questions[0])
        warm = _ttft(second, system + questions[2])
        assert second.engine.scheduler.stats().tier_hit_tokens > 0, "the tier was not read"
        second.engine.shutdown()
    return cold, warm


def _tenants_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = llm.engine.scheduler.stats()
    t0 = time.perf_counter()
    for prompt in prompts:  # in turn, as tenants' requests arrive
        llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.engine.scheduler.stats()
    reused = (after.prefix_cache_hits - before.prefix_cache_hits
              + after.tier_hit_tokens - before.tier_hit_tokens)
    return {"requests_per_s": len(prompts) / seconds,
            "reused": reused / sum(len(p) for p in prompts)}


def _index_rebuild_s(pages: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        store = PageStore(root, 1 << 40)
        for i in range(pages):
            store.put(hashlib.sha256(i.to_bytes(8, "little")).digest(), b"x" * 256)
        store.close()
        t0 = time.perf_counter()
        store = PageStore(root, 1 << 40, rebuild_wait_s=3600)
        seconds = time.perf_counter() - t0
        assert len(store) == pages
        store.close()
    return seconds


def run(model_dir: str, system_len: int, tenants: int, tenant_len: int, rounds: int,
        index_pages: int, log: Callable[[str], None], **settings) -> dict:
    rng = random.Random(0)
    vocab = 8000

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(system_len)
    best: dict[str, float] = {}
    for r in range(rounds):
        log(f"restart round {r + 1}/{rounds}")
        cold, warm = _restart_round(model_dir, system, [tokens(16) for _ in range(3)], settings)
        if "ttft_ratio" not in best or warm / cold < best["ttft_ratio"]:
            best |= {"cold_ttft_s": cold, "restart_ttft_s": warm, "ttft_ratio": warm / cold}
    page = settings["page_size"]
    pool_pages = tenants * tenant_len // 4 // page  # the tenants' prompts are 4x the pool
    prompts = [tokens(tenant_len) for _ in range(tenants)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    shaped = settings | {"num_pages": pool_pages}
    with tempfile.TemporaryDirectory() as kv_dir:
        engines = {"tier": LLM(model_dir, kv_cache_dir=kv_dir, **shaped),
                   "no_tier": LLM(model_dir, **shaped)}
        for llm in engines.values():  # the first pass fills pool and tier
            _tenants_pass(llm, [p + tokens(8) for p in prompts], params)
            if llm.engine.tier is not None:
                llm.engine.tier.flush()
        for r in range(rounds):
            log(f"tenants round {r + 1}/{rounds}")
            for name, llm in engines.items():
                got = _tenants_pass(llm, [p + tokens(8) for p in prompts], params)
                for key, value in got.items():
                    best[f"{name}_{key}"] = max(best.get(f"{name}_{key}", 0.0), value)
        for llm in engines.values():
            llm.engine.shutdown()
    log(f"rebuilding the index of {index_pages} pages")
    best["index_rebuild_s"] = min(_index_rebuild_s(index_pages) for _ in range(rounds))
    return best | {"pool_pages": pool_pages,
                   "tier_vs_no_tier": best["tier_requests_per_s"] / best["no_tier_requests_per_s"]}
