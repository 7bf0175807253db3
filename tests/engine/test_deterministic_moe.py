"""Deterministic inference with a mixture of experts: a probe's tokens and log-probabilities on a
random Qwen3-MoE (bf16, compiled, deterministic: what `serve` runs) are bit-identical to the probe
alone whatever shares its experts: ragged neighbours arriving at random steps, shared prefixes,
chunks of 8 tokens, a pool small enough to retract and evict, overlap (one engine, so one compile:
tests/engine/test_deterministic.py also compares big-chunk and eager runs on the dense model)."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_engine.config import EngineConfig
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.startup import build_engine
from tests.helpers.checkpoints import MOE, make_checkpoint
from tests.helpers.determinism import GREEDY, PROBE, SEEDED, others, run

pytestmark = pytest.mark.slow
REACHED: collections.Counter = collections.Counter()  # what the property's examples went through


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("moe")), "Qwen3MoeForCausalLM",
                           torch.bfloat16, vocab_size=8000, **MOE | {"norm_topk_prob": True})


@pytest.fixture(scope="module")
def tight(moe_dir):
    """Chunks of 8 tokens, pages of 4, 28 pages: retraction and eviction; overlap on."""
    engine = build_engine(EngineConfig(model=moe_dir, buckets=[1, 4], max_running=16,
                                       deterministic=True, num_pages=28, page_size=4,
                                       chunk_budget=8, overlap=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def alone(tight) -> dict:
    """The probe alone, on the otherwise idle engine."""
    assert tight.model.dtype == torch.bfloat16
    return {name: run(tight, [(0, "probe", PROBE, params)])["probe"]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=8),
    arrivals=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    probe_step=st.integers(0, 12),
    params=st.sampled_from(["greedy", "seeded"]),
    seed=st.integers(0, 2**16),
)
def test_moe_probe_is_bit_identical_to_the_probe_alone(
    tight, alone, prompts, arrivals, probe_step, params, seed
):
    rng = random.Random(seed)
    neighbours = [(arrivals[i], f"o{i}", p,
                   SamplingParams(max_tokens=rng.randrange(1, 25), temperature=rng.choice([0, 1]),
                                  ignore_eos=True, logprobs=rng.choice([None, 0, 3])))
                  for i, p in enumerate(others(prompts, rng))]
    scheduler = tight.scheduler
    before = scheduler.num_retractions, scheduler.book.cache.num_evicted_pages
    results = run(tight, [(probe_step, "probe", PROBE, GREEDY if params == "greedy" else SEEDED),
                          *neighbours])
    assert results["probe"] == alone[params]
    REACHED["retraction"] += scheduler.num_retractions > before[0]
    REACHED["eviction"] += scheduler.book.cache.num_evicted_pages > before[1]
    REACHED["examples"] += 1


def test_the_moe_property_went_through_retraction_and_eviction():
    """The property's examples (run just before, in this module) retracted and evicted at least
    once: the probe's bits held through both."""
    if not REACHED["examples"]:
        pytest.skip("the property test did not run in this session")
    assert REACHED["retraction"] > 0 and REACHED["eviction"] > 0, REACHED
