"""The compiled engine: same greedy tokens as transformers, and no compilation after warm-up."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from compiled_engine import LLM, SamplingParams
from compiled_engine.runner import precompiled
from tests.engine.conftest import NEW_TOKENS, ragged_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled_llm(demo_dir: str) -> LLM:
    return LLM(demo_dir, buckets=[1, 2, 4, 8], num_pages=2000, max_running=16)


def test_compiled_greedy_matches_transformers_without_recompiling(
    compiled_llm: LLM, hf_greedy
) -> None:
    # Four decode buckets, the dynamic extend graph and the dynamic-batch decode graph (batches of 9
    # to 16), compiled (or loaded precompiled) by the warm-up.
    # (no LoRA variant: the model has no adapters)
    assert set(compiled_llm.engine.runner.forward.graphs) == {
        (1, False), (2, False), (4, False), (8, False), ("decode", False), ("extend", False)
    }
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    prompts = ragged_prompts(37, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # 37 requests (mixed steps, every decode bucket, batches beyond the largest bucket), then batch
    # 1 and 3.
    outputs = compiled_llm.generate(prompts, params)
    outputs += compiled_llm.generate(prompts[:1], params) + compiled_llm.generate(
        prompts[1:4], params
    )
    for out, prompt in zip(outputs, prompts + prompts[:4]):
        assert out.token_ids == hf_greedy(prompt)
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup, (
        "a graph was compiled while serving"
    )
    assert precompiled.counts["guard_failed"] == 0
