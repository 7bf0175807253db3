"""The KV tier in the engine: a request's tokens and log-probs are bit-identical whether its
prompt's prefix was computed, found in the pool, loaded from the tier after the pool evicted it, or
loaded after a restart (deterministic mode; bf16, eager and compiled, and TP=2); a corrupt
page is recomputed, never read; another model's store is never read; one directory serves one
engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from compiled_engine.llm import LLM
from compiled_engine.private_dir import FolderBusy
from compiled_engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=2000)
PAGE = 16
PROMPT = [(7 * i) % 1900 + 5 for i in range(200)]  # 12 whole pages before its last position
OTHERS = [[(11 * i + j) % 1900 + 5 for i in range(150)] for j in range(3)]  # fill the pool
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
ENGINE = dict(deterministic=True, page_size=PAGE, num_pages=32, max_running=4)


def _checkpoint(path: Path, seed: int = 0) -> str:
    return add_demo_tokenizer(make_checkpoint(str(path), "LlamaForCausalLM", torch.bfloat16,
                                              seed=seed, **SHAPE))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("tier-model") / "base")


def _run(llm: LLM, prompt: list[int]) -> tuple[list[int], list, int, int, int]:
    """Tokens, log-probs, the prompt tokens taken from the pool and from the tier, and the prompt
    positions prefilled."""
    before = _stats(llm)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    after = _stats(llm)
    return (out.token_ids, out.logprobs,
            *(after[k] - before[k] for k in ("prefix_cache_hits", "tier_hit_tokens",
                                             "prefill_tokens")))


def _stats(llm: LLM) -> dict:
    engine = llm.engine
    if hasattr(engine, "scheduler"):
        return dataclasses.asdict(engine.scheduler.stats())
    return engine.stats()


def _flush(llm: LLM) -> None:
    llm.engine.tier.flush()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_recomputed_pooled_tiered_and_restarted_prefixes_give_the_same_bits(base, tmp_path,
                                                                           mode) -> None:
    kv_dir = tmp_path / "kv"
    kw = dict(kv_cache_dir=str(kv_dir), enforce_eager=mode == "eager", **ENGINE)
    llm = LLM(base, **kw)
    assert llm.engine.model.dtype == torch.bfloat16
    computed = _run(llm, PROMPT)
    assert computed[2:] == (0, 0, len(PROMPT))
    pooled = _run(llm, PROMPT)
    assert pooled[2:] == (12 * PAGE, 0, len(PROMPT) - 12 * PAGE), "the prefix from the pool"
    _flush(llm)
    for other in OTHERS:  # the pool (32 pages) evicts PROMPT's pages
        _run(llm, other)
    assert llm.engine.scheduler.cache.peek(tuple(PROMPT)) < 12
    tiered = _run(llm, PROMPT)
    assert tiered[3] > 0 and tiered[2] + tiered[3] == 12 * PAGE, "the rest from the tier"
    assert tiered[4] == len(PROMPT) - 12 * PAGE, "pages from the tier were prefilled"
    _flush(llm)
    llm.engine.shutdown()
    llm = LLM(base, **kw)  # a restart on the same directory
    restarted = _run(llm, PROMPT)
    assert restarted[2:] == (0, 12 * PAGE, len(PROMPT) - 12 * PAGE), (
        "after a restart the whole prefix from the tier, only the rest prefilled")
    for name, got in (("pool", pooled), ("tier", tiered), ("restart", restarted)):
        assert got[0] == computed[0], f"{name}: other tokens than computed"
        assert got[1] == computed[1], f"{name}: other log-probs than computed"
    llm.engine.shutdown()


@pytest.mark.slow
def test_a_corrupt_page_is_recomputed_and_one_directory_serves_one_engine(tmp_path) -> None:
    base = _checkpoint(tmp_path / "model")
    kv_dir = tmp_path / "kv"
    kw = dict(kv_cache_dir=str(kv_dir), enforce_eager=True, **ENGINE)
    llm = LLM(base, **kw)
    computed = _run(llm, PROMPT)
    _flush(llm)
    with pytest.raises(FolderBusy, match="another process uses the KV tier directory"):
        LLM(base, **kw)
    llm.engine.shutdown()
    files = sorted(kv_dir.glob("*/*/*.kv"))
    assert len(files) == 12
    fifth = llm.engine.tier.keys(tuple(PROMPT), {})[4].hex()
    damaged = next(f for f in files if f.stem == fifth)
    good = damaged.read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    llm = LLM(base, **kw)
    again = _run(llm, PROMPT)
    assert again[3] == 4 * PAGE, "pages before the damaged one from the tier, the rest computed"
    assert again[:2] == computed[:2]
    llm.engine.shutdown()
    assert damaged.read_bytes() == good, "the damaged page was replaced by the recomputed one"
    # the checkpoint rewritten in place (other weights, the same path): its pages are never read
    _checkpoint(tmp_path / "model", seed=7)
    llm = LLM(base, **kw)
    assert _run(llm, PROMPT)[3] == 0
    llm.engine.shutdown()
    assert len([p for p in kv_dir.iterdir() if p.is_dir()]) == 2, "a store per model"


@pytest.mark.slow
def test_pages_cached_at_a_retraction_are_stored_as_computed(base, tmp_path) -> None:
    """A pool too small for four long requests at once: decodes retract requests (their prompt and
    output pages are cached, then evicted and taken by others in the same plan). Each request's
    prompt + output asked again after a restart reads the tier and answers as an engine without
    one: every stored page holds the KV it is keyed by."""
    prompts = [[(13 * i + 7 * j) % 1900 + 5 for i in range(100)] for j in range(4)]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    kw = dict(ENGINE, enforce_eager=True, num_pages=24)
    llm = LLM(base, kv_cache_dir=str(tmp_path / "kv"), **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)]
    assert llm.engine.scheduler.stats().num_retractions > 0
    llm.engine.shutdown()
    turns = [p + o for p, o in zip(prompts, outs, strict=True)]
    llm = LLM(base, kv_cache_dir=str(tmp_path / "kv"), **kw)
    got = [_run(llm, t) for t in turns]
    assert sum(g[3] for g in got) > 0, "nothing came from the tier"
    llm.engine.shutdown()
    plain = LLM(base, **kw)
    want = [_run(plain, t) for t in turns]
    plain.engine.shutdown()
    assert [g[:2] for g in got] == [w[:2] for w in want]


@pytest.mark.slow
def test_tp2_reads_its_own_shards_after_a_restart(base, tmp_path) -> None:
    """Eager: the tier copies pages of the pool, whatever computed them (compiled TP=2 is the
    suite's in tests/distributed; this test's two compiles would cost a minute)."""
    kw = dict(kv_cache_dir=str(tmp_path / "kv"), tp_size=2, enforce_eager=True, **ENGINE)
    llm = LLM(base, **kw)
    try:
        computed = _run(llm, PROMPT)
    finally:
        llm.engine.shutdown()  # every rank's writer finishes first
    llm = LLM(base, **kw)
    try:
        restarted = _run(llm, PROMPT)
    finally:
        llm.engine.shutdown()
    assert restarted[3] == 12 * PAGE
    assert restarted[:2] == computed[:2]
    assert len([p for p in (tmp_path / "kv").iterdir() if p.is_dir()]) == 2, "a store per TP rank"
