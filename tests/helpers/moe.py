"""The MoE tests' random Qwen3-MoE / Qwen2-MoE checkpoints, prompts, engine settings, greedy run."""

from __future__ import annotations

import torch

from compiled_engine import LLM, SamplingParams
from tests.helpers.checkpoints import MOE, make_checkpoint
from tests.helpers.oracle import hf_fp32_greedy

PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
NEW_TOKENS = 10
ENGINE = dict(num_pages=512, max_running=8, chunk_budget=64)
CHECKPOINTS = {
    "Qwen3MoeForCausalLM": MOE | {"norm_topk_prob": True},
    # Qwen2-MoE: a shared expert beside the routed ones, weights not renormalized
    "Qwen2MoeForCausalLM": MOE | {"shared_expert_intermediate_size": 48, "norm_topk_prob": False},
}


def checkpoint_at(tmp_path_factory, arch: str, dtype: torch.dtype) -> tuple[str, list]:
    """A random checkpoint of `arch` stored in `dtype`; transformers fp32's greedy references."""
    path = make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, dtype, **CHECKPOINTS[arch])
    return path, hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]
