"""Mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with its shared expert) as `serve` runs them,
against transformers fp32 on random bf16 checkpoints."""

from __future__ import annotations

import pytest
import torch

from compiled_engine import LLM
from tests.helpers.moe import ENGINE, PROMPTS, checkpoint_at, greedy
from tests.helpers.oracle import TOP, Bounds, check, hf_bf16_spread


# Qwen3-MoE also under each COMPILED_ENGINE_CPU_ISA level below this CPU's (the Makefile's
# `-m parity` reruns); Qwen2-MoE's shared expert is a dense MLP, the same code at every level.
@pytest.mark.parametrize("arch", [pytest.param("Qwen3MoeForCausalLM", marks=pytest.mark.parity),
                                  "Qwen2MoeForCausalLM"])
def test_compiled_bf16_in_the_parity_bound_and_batch_invariant(tmp_path_factory, arch) -> None:
    """`serve`'s defaults (compiled, the checkpoint's bf16, deterministic): log-probs within
    transformers' own bf16 distance from fp32; a probe's tokens the same alone and in a crowd (a
    token's experts' outputs never depend on which other tokens share them)."""
    path, refs = checkpoint_at(tmp_path_factory, arch, torch.bfloat16)
    bound = Bounds.bf16(hf_bf16_spread(path, PROMPTS, refs, top=TOP))
    llm = LLM(path, deterministic=True, **ENGINE)
    assert llm.engine.model.dtype == torch.bfloat16
    check(llm, PROMPTS, refs, bound, f"{arch} compiled bf16")
    probe = PROMPTS[0]
    alone = greedy(llm, [probe])[0]
    crowd = [list(range(200 + i, 230 + 3 * i)) for i in range(6)]
    assert greedy(llm, [*crowd[:3], probe, *crowd[3:]])[3] == alone
