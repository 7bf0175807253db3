"""vLLM's `cache_salt`: requests of different salts share no prefix-cache page, in the pool or in
the KV tier (a tenant cannot learn from its cache hits what another tenant asked); requests of the
same salt share as before; no salt is a partition of its own. Tokens never change with the salt."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_engine.kv_events.publisher import to_events
from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.prefix_cache import CacheStored
from compiled_engine.scheduler.request import cache_key_tokens, salt_namespace
from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint

PAGE = 16
PROMPT = [(7 * i) % 1900 + 5 for i in range(200)]  # 12 whole pages before its last position
CACHED = 12 * PAGE
ENGINE = dict(deterministic=True, page_size=PAGE, num_pages=64, max_running=4, enforce_eager=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("salt-model") / "base"
    return add_demo_tokenizer(make_checkpoint(str(path), "LlamaForCausalLM", torch.bfloat16,
                                              hidden_size=128, intermediate_size=256,
                                              vocab_size=2000))


def _run(llm: LLM, salt: str | None) -> tuple[list[int], int, int]:
    """The tokens of PROMPT under `salt`, and its prompt tokens from the pool and from the tier."""
    before = dataclasses.asdict(llm.engine.scheduler.stats())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, cache_salt=salt)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    after = dataclasses.asdict(llm.engine.scheduler.stats())
    return out, *(after[k] - before[k] for k in ("prefix_cache_hits", "tier_hit_tokens"))


def test_salts_partition_the_prefix_cache(model) -> None:
    llm = LLM(model, **ENGINE)
    try:
        first, hits, _ = _run(llm, "tenant-a")
        assert hits == 0
        other, hits, _ = _run(llm, "tenant-b")
        assert hits == 0, "another salt's prompt was found in the cache"
        same, hits, _ = _run(llm, "tenant-a")
        assert hits == CACHED, "the same salt shares its prefix as before"
        plain, hits, _ = _run(llm, None)
        assert hits == 0, "no salt is a partition of its own"
        again, hits, _ = _run(llm, None)
        assert hits == CACHED
        assert first == other == same == plain == again, "the salt changed the tokens"
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            _run(llm, "")
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_salts_partition_the_kv_tier(model, tmp_path) -> None:
    """After a restart (an empty pool) only the salt that stored the prompt's pages reads them."""
    kw = dict(ENGINE, kv_cache_dir=str(tmp_path / "kv"))
    llm = LLM(model, **kw)
    try:
        first, _, _ = _run(llm, "tenant-a")
        llm.engine.tier.flush()
    finally:
        llm.engine.shutdown()
    llm = LLM(model, **kw)
    try:
        other, hits, tier = _run(llm, "tenant-b")
        assert (hits, tier) == (0, 0), "another salt's pages were read from the tier"
        plain, hits, tier = _run(llm, None)
        assert (hits, tier) == (0, 0), "a request without a salt read a salted prompt's pages"
    finally:
        llm.engine.shutdown()
    llm = LLM(model, **kw)  # again from an empty pool: the salt's own pages are there
    try:
        same, hits, tier = _run(llm, "tenant-a")
        assert (hits, tier) == (0, CACHED), "the same salt reads its pages from the tier"
    finally:
        llm.engine.shutdown()
    assert first == other == plain == same


def test_kv_events_hash_the_salt_into_every_block() -> None:
    """Routers see the same token ids but other block hashes for another salt."""
    tokens = tuple(range(10, 10 + 2 * PAGE))
    events = {salt: to_events([CacheStored(cache_key_tokens(tokens, 0, salt_namespace(salt)), 0,
                                           (1, 2))], PAGE)[0]
              for salt in (None, "tenant-a", "tenant-b")}
    assert all(ev.token_ids == list(tokens) for ev in events.values())
    hashes = [set(ev.block_hashes) for ev in events.values()]
    assert not hashes[0] & hashes[1] and not hashes[0] & hashes[2] and not hashes[1] & hashes[2]
