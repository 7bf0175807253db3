"""Every engine path gives transformers' greedy tokens: eager and compiled, overlap on and off,
chunked prefill, radix and naive prefix caches, forced retraction, page sizes 1 and 16, batches of 1
and 37, and the same with `--no-deterministic`."""

from __future__ import annotations

import pytest

from compiled_engine import LLM, SamplingParams
from tests.engine.conftest import NEW_TOKENS, ragged_prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = ragged_prompts(37)

PATHS = {
    "eager-overlap": dict(overlap=True),
    "eager-no-overlap": dict(overlap=False),
    "chunked-tiny-budget": dict(chunk_budget=7),
    "prefill-decode-not-mixed": dict(mixed=False, chunk_budget=64),
    "naive-cache": dict(prefix_cache="naive"),
    "page-size-16": dict(page_size=16, num_pages=300),
    "retraction-tiny-pool": dict(num_pages=140, max_running=37),
    "retraction-tiny-pool-pages-16": dict(
        page_size=16, num_pages=12, max_running=37, overlap=False
    ),
    "no-deterministic-chunked-naive-cache": dict(
        deterministic=False, chunk_budget=7, prefix_cache="naive"
    ),
}


def assert_matches_oracle(outputs, prompts, hf_greedy) -> None:
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.token_ids == hf_greedy(prompt), (
            f"prompt {i} (len {len(prompt)}) diverged from transformers"
        )
        assert out.finish_reason == "length"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_batch_of_37_ragged_requests_matches_transformers(
    path: str, demo_dir: str, hf_greedy
) -> None:
    settings = dict(enforce_eager=True, num_pages=2000, max_running=16) | PATHS[path]
    llm = LLM(demo_dir, **settings)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert_matches_oracle(outputs, PROMPTS, hf_greedy)
    llm.engine.scheduler.check_integrity()
    stats = llm.engine.scheduler.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_retraction_really_happened_with_a_tiny_pool(demo_dir: str, hf_greedy) -> None:
    llm = LLM(demo_dir, enforce_eager=True, num_pages=140, max_running=37)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert_matches_oracle(outputs, PROMPTS, hf_greedy)
    assert llm.engine.scheduler.stats().num_retractions > 0


def test_radix_cache_reuses_shared_prefixes(demo_dir: str, hf_greedy) -> None:
    llm = LLM(demo_dir, enforce_eager=True, num_pages=2000, max_running=4)
    first = llm.generate(PROMPTS[:3], GREEDY)
    again = llm.generate(PROMPTS[:3], GREEDY)  # now fully cached but the last prompt token
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert_matches_oracle(again, PROMPTS[:3], hf_greedy)
    assert llm.engine.scheduler.stats().cache_hit_rate > 0.4


def test_no_deterministic_compiled_with_overlap_and_retraction_matches_transformers(
    demo_dir: str, hf_greedy
) -> None:
    """`--no-deterministic` (oneDNN / BLAS GEMMs, split attention), compiled as `serve` runs it,
    overlapped, with a pool small enough to retract."""
    llm = LLM(demo_dir, deterministic=False, overlap=True, num_pages=140, max_running=37)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert_matches_oracle(outputs, PROMPTS, hf_greedy)
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.stats().num_retractions > 0


def test_batch_of_one_matches_transformers(demo_dir: str, hf_greedy) -> None:
    llm = LLM(demo_dir, enforce_eager=True, num_pages=200, max_running=1)
    for prompt in PROMPTS[:3]:
        assert_matches_oracle(llm.generate([prompt], GREEDY), [prompt], hf_greedy)
