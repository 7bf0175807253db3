"""Quantized experts kept packed: a Qwen3-MoE GGUF file written as llama.cpp writes one (each
layer's experts stacked per projection) keeps each projection's experts as one `PackedWeight` of
the file's blocks, and `--quantization int8` packs the experts of a safetensors checkpoint as it
packs every linear. Against transformers fp32 on the same file (which dequantizes it through the
`gguf` package) or on the checkpoint quantized to int8 and back:
- fp32 compute (blocks dequantized, multiplied in fp32): greedy tokens equal, log-probs within
  1e-4;
- bf16 compute (the native packed kernel on each expert's rows interleaved 16 at a time): within
  the parity bound of transformers' own bf16 run, compiled as `serve` runs it;
- TP=2: each rank's slice of the blocks, bit for bit, and fp32 answers as above.
The op itself on packed experts: tests/models/test_qwen_moe.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from _gguf_utils import write_gguf

from compiled_engine import LLM
from compiled_engine.models.demo import demo_model_dir
from compiled_engine.models.loader import load_model
from compiled_engine.parallel import parallel_state as ps
from kernels.packed import FORMATS, PackedWeight, quantize
from tests.helpers.checkpoints import PACKED_SHAPE, make_checkpoint
from tests.helpers.oracle import Bounds, check, hf_bf16_spread, hf_fp32_greedy

Q = gguf.GGMLQuantizationType
# the dense packed tests' shape (K-quant rows of 256), every layer routed; the experts' intermediate
# size is Qwen3-MoE's default, 768 (transformers' GGUF reader ignores `expert_feed_forward_length`),
# 384 per rank at TP=2
SHAPE = PACKED_SHAPE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768,
                            mlp_only_layers=[], norm_topk_prob=True)
# beside Q4_K experts, one layer's down projections in Q6_K: a Q4_K_M file's choice varies by layer,
# while every routed layer runs the same compiled region
MIX = {"layers.0.mlp.experts.down_proj": Q.Q6_K}
PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
NEW_TOKENS = 8
ENGINE = dict(num_pages=1024, max_running=8, chunk_budget=256)
FP32 = Bounds.exact(1e-4)
ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("moe")), ARCH, **SHAPE)


@pytest.fixture(scope="module")
def files(hf_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {q.name: write_gguf(hf_dir, root / f"{q.name}.gguf", q) for q in (Q.Q8_0, Q.Q4_1)}
    out["Q4_K_M"] = write_gguf(hf_dir, root / "Q4_K_M.gguf", Q.Q4_K, mix=MIX)
    return out


def expert_formats(llm: LLM) -> list[tuple[str, str]]:
    """Each layer's (w13, w2) block format names ("dense" for a parameter)."""
    def name(w: object) -> str:
        return w.format.name if isinstance(w, PackedWeight) else "dense"

    return [(name(layer.mlp.experts.w13), name(layer.mlp.experts.w2))
            for layer in llm.engine.model.model.layers]


def bf16_bound(path: str, refs: list) -> Bounds:
    spread = hf_bf16_spread(path, PROMPTS, refs, top=5)
    print(f"transformers bf16 vs fp32 on {Path(path).name}: {spread}")
    return Bounds.bf16(spread)


@pytest.mark.parametrize("name, formats", [("Q8_0", [("Q8_0", "Q8_0")] * 2),
                                           ("Q4_1", [("Q4_1", "Q4_1")] * 2),
                                           ("Q4_K_M", [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")])])
def test_gguf_experts_kept_packed_equal_transformers_fp32(files, name: str, formats: list) -> None:
    path = str(files[name])
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    assert expert_formats(llm) == formats
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.w13.shape == (4, 2 * 768, 256) and experts.w2.shape == (4, 256, 768)
    agreement = check(llm, PROMPTS, hf_fp32_greedy(path, PROMPTS, NEW_TOKENS), FP32,
                      f"{name} experts eager fp32")
    assert not agreement.divergences


def test_each_rank_keeps_its_slice_of_the_experts_packed(files, monkeypatch) -> None:
    """Rank 1 of 2: its half of each expert's gate, up (rows) and down (columns) as the file's
    blocks, bit for bit; Q4_K_M's Q6_K down cannot be cut at column 384 (blocks of 256): that one
    is dequantized on the rank, its gate/up stay packed."""
    whole = load_model(str(files["Q8_0"]), dtype="float32")[0].model.layers[0].mlp.experts
    monkeypatch.setattr(ps, "_size", 2)
    monkeypatch.setattr(ps, "_rank", 1)
    experts = load_model(str(files["Q8_0"]), dtype="float32")[0].model.layers[0].mlp.experts
    assert isinstance(experts.w13, PackedWeight) and experts.w13.shape == (4, 768, 256)
    assert isinstance(experts.w2, PackedWeight) and experts.w2.shape == (4, 256, 384)
    # gate rows 384:768 and up rows 1152:1536 of each expert; down's columns 384: (blocks 12 on)
    w13 = whole.w13.blocks
    assert torch.equal(experts.w13.blocks, torch.cat([w13[:, 384:768], w13[:, 1152:]], 1))
    assert torch.equal(experts.w2.blocks, whole.w2.blocks[:, :, 12 * 34:])
    mixed = load_model(str(files["Q4_K_M"]), dtype="float32")[0].model.layers[0].mlp.experts
    assert mixed.w13.format.name == "Q4_K" and not isinstance(mixed.w2, PackedWeight)


@pytest.mark.slow
def test_bf16_compiled_packed_experts_within_the_parity_bound(files) -> None:
    """What `serve` runs on a Q4_K_M Qwen3-MoE file: compiled, deterministic, bf16, every
    expert's blocks interleaved for the native kernel; the two routed layers hold different down
    formats and run one compile region."""
    path = str(files["Q4_K_M"])
    refs = hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)
    llm = LLM(path, deterministic=True, **ENGINE)
    assert expert_formats(llm) == [("Q4_Kx16", "Q6_Kx16"), ("Q4_Kx16", "Q4_Kx16")]
    check(llm, PROMPTS, refs, bf16_bound(path, refs), "Q4_K_M experts compiled bf16")


def test_tp2_packed_experts_equal_transformers_fp32(files) -> None:
    """TP=2 splits each expert's intermediate dim: Q8_0 gate/up rows and down's blocks of 32
    columns (384 per rank) stay packed on each rank; fp32 (the exact path; eager: the compiled TP
    path is tests/models/test_qwen_moe.py's) gives transformers' greedy tokens and log-probs
    within 1e-4."""
    path = str(files["Q8_0"])
    refs = hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)
    two = LLM(path, dtype="float32", tp_size=2, enforce_eager=True, **ENGINE)
    try:
        agreement = check(two, PROMPTS, refs, FP32, "Q8_0 experts TP=2 eager fp32")
        assert not agreement.divergences
    finally:
        two.engine.shutdown()


def int8_round_trip(path: str, out: str) -> str:
    """The checkpoint as `--quantization int8` holds it: every projection (attention, experts;
    not the router, embedding or LM head) quantized to I8 and back, saved in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.copy_(quantize(param.data, FORMATS["I8"]).dequantize())
    hf.save_pretrained(out)
    return out


def test_int8_quantization_packs_the_experts(tmp_path: Path) -> None:
    """`--quantization int8` on a bf16 Qwen3-MoE checkpoint: experts I8 (interleaved for bf16),
    within the parity bound of transformers fp32 on the int8 weights (the checkpoint quantized and
    dequantized: the error is the engine's, not the quantization's)."""
    path = make_checkpoint(str(tmp_path / "bf16"), ARCH, torch.bfloat16, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (Path(path) / name).write_bytes((Path(demo_model_dir()) / name).read_bytes())
    int8 = int8_round_trip(path, str(tmp_path / "int8"))
    refs = hf_fp32_greedy(int8, PROMPTS, NEW_TOKENS)
    llm = LLM(path, enforce_eager=True, quantization="int8", **ENGINE)
    assert expert_formats(llm) == [("I8x16", "I8x16")] * SHAPE["num_hidden_layers"]
    check(llm, PROMPTS, refs, bf16_bound(int8, refs), "int8 experts eager bf16")
