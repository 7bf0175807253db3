"""Qwen3-MoE and Qwen2-MoE (shared expert) on random checkpoints against transformers fp32, and the
fused MoE op against a per-token reference on ragged expert loads (experts with no token
included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.layers.moe import FusedMoE
from kernels import ops
from kernels.packed import FORMATS, quantize
from tests.helpers.checkpoints import MOE, make_checkpoint
from tests.helpers.moe import CHECKPOINTS, ENGINE, NEW_TOKENS, PROMPTS, checkpoint_at
from tests.helpers.oracle import Bounds, check, hf_fp32_greedy

FP32 = Bounds.exact(1e-4)


def reference_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Per token, per chosen expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += topk_weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(
                gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_equals_the_reference_on_ragged_loads(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, k = 6, 64, 32, 23, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 8).to(dtype)
    # expert 0 takes most tokens, 3 and 5 none, the rest a few
    ids = torch.tensor([[0, [1, 2, 4][t % 3]] if t % 4 else [[2, 4][t % 2], 0]
                        for t in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    got = ops.fused_moe(x, w13, w2, weights, ids, False)
    want = reference_moe(x, w13, w2, weights, ids)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (got.double() - want).abs().max().item() <= tolerance
    # deterministic mode: a token's output is the same bits alone as in any batch
    together = ops.fused_moe(x, w13, w2, weights, ids, True)
    for t in (0, 5, 22):
        alone = ops.fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], True)
        assert torch.equal(alone[0], together[t])


@pytest.mark.parametrize("fmt", ["I8", "I4"])
def test_fused_moe_on_packed_experts(fmt: str) -> None:
    """Experts held as blocks (`--quantization`'s formats): fp32 activations equal the reference
    on the dequantized weights; bf16 ones go through the native packed kernel on each expert's
    rows interleaved 16 at a time, near the reference and the same bits alone as in the batch; the
    load is counted under the packed weight."""
    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, k = 6, 64, 32, 23, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = quantize(torch.randn(experts, 2 * inter, hidden, generator=gen) / 8, FORMATS[fmt])
    w2 = quantize(torch.randn(experts, hidden, inter, generator=gen) / 8, FORMATS[fmt])
    ids = torch.tensor([[t % 4, (t + 1) % 4] for t in range(tokens)])  # experts 4, 5: none
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    want = reference_moe(x, w13.dequantize(), w2.dequantize(), weights, ids)
    got = ops.fused_moe(x, w13, w2, weights, ids, False)
    assert (got.double() - want).abs().max().item() <= 1e-4
    for w in (w13, w2):
        ops.prepare_packed(w, torch.bfloat16)
    assert (w13.format.name, w2.format.name) == (f"{fmt}x16", f"{fmt}x16")
    together = ops.fused_moe(x.bfloat16(), w13, w2, weights, ids, True)
    assert (together.double() - want).abs().max().item() <= 0.1
    for t in (0, 5, 22):
        alone = ops.fused_moe(x[t : t + 1].bfloat16(), w13, w2, weights[t : t + 1],
                              ids[t : t + 1], True)
        assert torch.equal(alone[0], together[t])
    routed = torch.cat([ids, ids[[0, 5, 22]]]).flatten()  # since the relayout: the batch, 3 alone
    assert ops.expert_tokens(w13) == torch.bincount(routed, minlength=experts).tolist()


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def fp32_checkpoint(request, tmp_path_factory) -> tuple[str, list]:
    return checkpoint_at(tmp_path_factory, request.param, torch.float32)


def test_eager_fp32_equals_transformers_fp32(fp32_checkpoint) -> None:
    assert_fp32_equals_transformers(*fp32_checkpoint, eager=True)


def test_compiled_fp32_equals_transformers_fp32(tmp_path_factory) -> None:
    """Compiled (Qwen3-MoE; Qwen2-MoE runs compiled in bf16 in tests/parity/test_moe_parity.py)."""
    assert_fp32_equals_transformers(
        *checkpoint_at(tmp_path_factory, "Qwen3MoeForCausalLM", torch.float32), eager=False)


def assert_fp32_equals_transformers(path: str, refs: list, eager: bool) -> None:
    llm = LLM(path, dtype="float32", enforce_eager=eager, **ENGINE)
    assert sum(1 for m in llm.engine.model.modules() if isinstance(m, FusedMoE)) == 1
    mode = "eager" if eager else "compiled"
    agreement = check(llm, PROMPTS, refs, FP32, f"{Path(path).name} {mode} fp32")
    assert not agreement.divergences


def test_sparse_step_picks_the_routed_layers_as_transformers_does(tmp_path: Path) -> None:
    """`decoder_sparse_step=2` over 4 layers, none listed dense: layers 1 and 3 routed, 0 and 2
    plain MLPs (transformers' rule), and the answers transformers fp32's."""
    shape = MOE | {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [],
                   "num_hidden_layers": 4}
    path = make_checkpoint(str(tmp_path / "moe"), "Qwen3MoeForCausalLM", **shape)
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    routed = [i for i, layer in enumerate(llm.engine.model.model.layers)
              if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)]
    assert routed == [1, 3]
    agreement = check(llm, PROMPTS, hf_fp32_greedy(path, PROMPTS, NEW_TOKENS), FP32,
                      "Qwen3-MoE sparse step 2 eager fp32")
    assert not agreement.divergences


# Qwen2-MoE's shared expert adds a second all-reduce per layer; eager there (the compiled TP path
# is Qwen3-MoE's, the same decoder)
@pytest.mark.parametrize("arch, eager", [("Qwen3MoeForCausalLM", False),
                                         ("Qwen2MoeForCausalLM", True)])
def test_tp2_equals_transformers_fp32(tmp_path_factory, arch: str, eager: bool) -> None:
    """Each expert's intermediate dimension split over two ranks, one all-reduce per MoE layer."""
    path, refs = checkpoint_at(tmp_path_factory, arch, torch.float32)
    llm = LLM(path, dtype="float32", tp_size=2, enforce_eager=eager, **ENGINE)
    try:
        agreement = check(llm, PROMPTS, refs, FP32, f"{arch} TP=2 fp32")
        assert not agreement.divergences
    finally:
        llm.engine.shutdown()


def test_expert_load_counts_every_routed_token_and_reaches_metrics(fp32_checkpoint) -> None:
    """Each token computed through a routed layer is counted once per expert it went to (top-k:
    k times; a step's padding rows, which run through the experts too, included: eager, one per
    prefill step), and /metrics shows each layer's experts' totals and their relative loads."""
    from compiled_engine.layers.moe import expert_load
    from compiled_engine.ranks.adapter_wait import AdapterWait
    from compiled_engine.ranks.grammar_wait import GrammarWait
    from compiled_engine.ranks.messages import StatsRequest
    from compiled_engine.ranks.rank_loop import Waits
    from compiled_engine.ranks.rank_loop import _stats as rank_stats
    from compiled_engine.ranks.tier_wait import TierWait
    from server.metrics import Metrics

    path, _ = fp32_checkpoint
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    assert expert_load(llm.engine.model) == {1: [0, 0, 0, 0]}  # layer 0 is dense
    max_tokens = 5
    llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    load = expert_load(llm.engine.model)
    computed = sum(len(p) + max_tokens - 1 for p in PROMPTS)  # the last token is never fed back
    k = MOE["num_experts_per_tok"]
    assert computed * k <= sum(load[1]) <= (computed + llm.engine.steps) * k
    assert sum(load[1]) % k == 0
    metrics = Metrics()  # fed as the server feeds it: rank 0's stats reply
    waits = Waits(GrammarWait(llm.engine.features.grammars), AdapterWait(llm.engine),
                  TierWait(llm.engine))
    stats = rank_stats(llm.engine, waits, StatsRequest(0)).stats
    assert stats["expert_tokens"] == load
    metrics.set_engine_stats(stats, 0)
    text = metrics.render().decode()
    for expert, n in enumerate(load[1]):
        assert f'compiled_engine_moe_expert_tokens_total{{expert="{expert}",layer="1"}} {n:.1f}' \
            in text
    # the histogram: each expert's tokens over the layer's mean per expert, one observation each
    relative = [n * len(load[1]) / sum(load[1]) for n in load[1]]
    hist = 'compiled_engine_moe_expert_relative_load'
    assert f'{hist}_count{{layer="1"}} 4.0' in text
    for le in ("0.9", "1.1", "2.0"):
        below = sum(r <= float(le) for r in relative)
        assert f'{hist}_bucket{{layer="1",le="{le}"}} {below:.1f}' in text
    # nothing computed since: a poll adds no observation; totals counted from zero again (a reset)
    # are new tokens, never a negative load
    metrics.set_engine_stats(stats, 0)
    assert f'{hist}_count{{layer="1"}} 4.0' in metrics.render().decode()
    metrics.set_engine_stats(stats | {"expert_tokens": {1: [2, 0, 0, 2]}}, 0)
    text = metrics.render().decode()
    assert f'{hist}_bucket{{layer="1",le="0.0"}} {sum(r == 0 for r in relative) + 2:.1f}' in text
    assert f'{hist}_count{{layer="1"}} 8.0' in text
    assert f'compiled_engine_moe_expert_tokens_total{{expert="0",layer="1"}} {load[1][0] + 2:.1f}' \
        in text
    metrics.set_engine_stats(stats | {"expert_tokens": {1: [2, 0, 0, 2]}}, 0)  # and nothing since
    assert f'{hist}_count{{layer="1"}} 8.0' in metrics.render().decode()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU in the interpreter only (make test "
                           "sets TRITON_INTERPRET=1)")
def test_triton_fused_moe_equals_the_portable_op_in_the_interpreter() -> None:
    """The CUDA kernels (`kernels.triton.moe`) on CPU tensors: the portable op's output, tokens per
    expert counted, ragged loads (an expert with none, one with most), each token the same alone."""
    from kernels.triton.moe import fused_moe_triton

    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, k = 5, 48, 40, 37, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 8
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 8
    ids = torch.tensor([[0, [1, 2, 4][t % 3]] if t % 5 else [4, 0] for t in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    got, counts = fused_moe_triton(x, w13, w2, weights, ids)
    want = ops.fused_moe(x, w13, w2, weights, ids, False)
    assert (got - want).abs().max().item() <= 1e-4
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    assert counts[3] == 0
    # A token alone equals itself after a whole tile (16 rows) of tokens sharing its experts: the
    # interpreter's tile product (numpy) may round a row differently at another position inside a
    # tile, which a GPU's MMA does not (as test_kernels_triton_invariant.py says).
    crowd = torch.cat([ids[:1].expand(16, k), ids])
    together, _ = fused_moe_triton(torch.cat([x[5:21], x]), w13, w2,
                                   torch.cat([weights[5:21], weights]), crowd)
    alone, _ = fused_moe_triton(x[:1], w13, w2, weights[:1], ids[:1])
    assert torch.equal(alone[0], together[16])
    # packed experts (the CUDA op's route: dequantized inside the op, then the same kernels), the
    # load counted under the blocks; hidden and intermediate sizes in whole blocks of 32
    x = torch.randn(tokens, 64, generator=gen)
    packed13 = quantize(torch.randn(experts, 64, 64, generator=gen) / 8, FORMATS["I8"])
    packed2 = quantize(torch.randn(experts, 64, 32, generator=gen) / 8, FORMATS["I8"])
    got = ops._fused_moe_cuda(x, packed13.blocks, packed2.blocks, weights, ids, True,
                              packed13.code, packed2.code)
    want = reference_moe(x, packed13.dequantize(), packed2.dequantize(), weights, ids)
    assert (got.double() - want).abs().max().item() <= 1e-4
    assert ops.expert_tokens(packed13) == counts.tolist()
