"""Deterministic inference with a mixture of experts: a probe's tokens and log-probabilities on a
random Qwen3-MoE (bf16, compiled, deterministic: what `serve` runs) are bit-identical to the probe
alone whatever shares its experts: ragged neighbours arriving at random steps, shared prefixes,
chunks of 8 tokens, a pool small enough to retract and evict, overlap."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_engine.config import EngineConfig
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.startup import build_engine
from tests.engine.test_deterministic import GREEDY, PROBE, SEEDED, _others, _run
from tests.models._model_utils import MOE, make_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("moe")), "Qwen3MoeForCausalLM",
                           torch.bfloat16, vocab_size=8000, **MOE | {"norm_topk_prob": True})


def _engine(path: str, **kw):
    return build_engine(EngineConfig(model=path, buckets=[1, 4], max_running=16,
                                     deterministic=True, **kw))


@pytest.fixture(scope="module")
def roomy(moe_dir):
    engine = _engine(moe_dir, num_pages=4096, chunk_budget=8192)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tight(moe_dir):
    engine = _engine(moe_dir, num_pages=28, page_size=4, chunk_budget=8, overlap=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def alone(roomy) -> dict:
    assert roomy.model.dtype == torch.bfloat16
    return {name: _run(roomy, [(0, "probe", PROBE, params)])["probe"]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=8),
    arrivals=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    probe_step=st.integers(0, 12),
    which=st.sampled_from(["roomy", "tight"]),
    params=st.sampled_from(["greedy", "seeded"]),
    seed=st.integers(0, 2**16),
)
def test_moe_probe_is_bit_identical_to_the_probe_alone(
    roomy, tight, alone, prompts, arrivals, probe_step, which, params, seed
):
    rng = random.Random(seed)
    others = [(arrivals[i], f"o{i}", p,
               SamplingParams(max_tokens=rng.randrange(1, 25), temperature=rng.choice([0, 1]),
                              ignore_eos=True, logprobs=rng.choice([None, 0, 3])))
              for i, p in enumerate(_others(prompts, rng))]
    engine = roomy if which == "roomy" else tight
    results = _run(engine, [(probe_step, "probe", PROBE, GREEDY if params == "greedy" else SEEDED),
                            *others])
    assert results["probe"] == alone[params]
