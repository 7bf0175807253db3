"""GGUF weights kept packed: random checkpoints written as llama.cpp writes them, in every block
format the kernels know (and a K-quant mix, Q6_K v beside Q4_K q and k, as a Q4_K_M file holds),
load with their linears and embedding packed, and answer as transformers fp32 does on the same file
(which dequantizes it through the `gguf` package):
- fp32 compute (the exact path: blocks dequantized, multiplied in fp32): greedy tokens equal and
  log-probs within 1e-4;
- bf16 compute, eager and compiled (the native kernels, which quantize activations to int16 per
  row and block of 32, on the weights' rows interleaved 16 at a time): greedy tokens equal up to
  near ties, log-probs within the parity bound of
  transformers' own bf16 run (`tests.helpers.oracle`), the error printed;
- TP=2 (columns and rows of blocks split over two ranks): TP=1's tokens, within the same bound.
`--quantization int8` on a safetensors checkpoint is held to the same bound (against fp32 on the
original weights)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from _gguf_utils import write_gguf

from compiled_engine import LLM, SamplingParams
from compiled_engine.models.demo import demo_model_dir
from kernels.packed import PackedWeight
from tests.helpers.checkpoints import PACKED_SHAPE, make_checkpoint
from tests.helpers.oracle import Bounds, check, hf_bf16_spread, hf_fp32_greedy

Q = gguf.GGMLQuantizationType
FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
MIX = {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K}  # beside Q4_K: what a Q4_K_M file holds
PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
NEW_TOKENS = 8
ENGINE = dict(num_pages=1024, max_running=8, chunk_budget=256)
FP32 = Bounds.exact(1e-4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM",
                           **PACKED_SHAPE)


@pytest.fixture(scope="module")
def files(hf_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {q.name: write_gguf(hf_dir, root / f"{q.name}.gguf", q) for q in FORMATS}
    out["Q4_K_M"] = write_gguf(hf_dir, root / "Q4_K_M.gguf", Q.Q4_K, mix=MIX)
    return out


def packed_formats(llm: LLM) -> set[str]:
    return {m.format.name for m in llm.engine.model.modules() if isinstance(m, PackedWeight)}


def layer_weights(llm: LLM) -> dict[str, object]:
    layer = llm.engine.model.model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
            "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
            "embed": llm.engine.model.model.embed_tokens.weight}


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_each_format_kept_packed_equals_transformers_fp32(files, qtype: Q) -> None:
    path = str(files[qtype.name])
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    weights = layer_weights(llm)
    assert all(isinstance(w, PackedWeight) and w.format.name == qtype.name
               for w in weights.values()), weights
    agreement = check(llm, PROMPTS, hf_fp32_greedy(path, PROMPTS, NEW_TOKENS), FP32,
                      f"{qtype.name} eager fp32")
    assert not agreement.divergences


def test_a_k_quant_mix_keeps_each_format(files) -> None:
    """q and k in Q4_K, v in Q6_K: the fused qkv weight holds two packed runs of rows."""
    path = str(files["Q4_K_M"])
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    qkv = layer_weights(llm)["qkv"]
    assert isinstance(qkv, torch.nn.ModuleList)
    assert [(w.format.name, w.out_features) for w in qkv] == [("Q4_K", 256 + 128), ("Q6_K", 128)]
    assert layer_weights(llm)["down"].format.name == "Q6_K"
    check(llm, PROMPTS, hf_fp32_greedy(path, PROMPTS, NEW_TOKENS), FP32, "Q4_K_M eager fp32")


def assert_linears_interleaved(llm: LLM) -> None:
    """bf16 on the CPU: every packed linear (the LM head too) held 16 rows interleaved, which the
    x16 kernel reads; the untied embedding, only looked up, in the file's layout."""
    weights = layer_weights(llm)
    runs = [w for k in ("qkv", "o", "gate_up", "down")
            for w in (weights[k] if isinstance(weights[k], torch.nn.ModuleList) else [weights[k]])]
    runs.append(llm.engine.model.lm_head.weight)
    assert all(w.format.name.endswith("x16") for w in runs), [w.format.name for w in runs]
    assert weights["embed"] is not llm.engine.model.lm_head.weight
    assert not weights["embed"].format.name.endswith("x16")


def bf16_bound(path: str, refs: list) -> Bounds:
    spread = hf_bf16_spread(path, PROMPTS, refs, top=5)
    print(f"transformers bf16 vs fp32 on {Path(path).name}: {spread}")
    return Bounds.bf16(spread)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K", "Q6_K"])
def test_bf16_native_kernel_within_the_parity_bound(files, name: str) -> None:
    """The default dtype of a quantized file (bf16), eager: each format's native kernel."""
    path = str(files[name])
    refs = hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)
    llm = LLM(path, enforce_eager=True, **ENGINE)
    assert llm.engine.model.dtype == torch.bfloat16
    assert_linears_interleaved(llm)
    check(llm, PROMPTS, refs, bf16_bound(path, refs), f"{name} eager bf16")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K_M"])
def test_bf16_compiled_within_the_parity_bound(files, name: str) -> None:
    """What `serve` runs on such a file: compiled, deterministic, bf16."""
    path = str(files[name])
    refs = hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)
    llm = LLM(path, deterministic=True, **ENGINE)
    assert_linears_interleaved(llm)
    check(llm, PROMPTS, refs, bf16_bound(path, refs), f"{name} compiled bf16")


@pytest.mark.slow
def test_tp2_compiled_agrees_with_tp1_and_transformers(files) -> None:
    """Column-parallel layers split rows of blocks, row-parallel ones split each row's blocks (K/2
    = 128: whole Q4_1 blocks): TP=2 compiled gives TP=1's greedy tokens and stays within the parity
    bound of transformers fp32 (its log-probs are not TP=1's bits: each rank's partial sums are
    rounded to bf16 before the all-reduce; measured up to 0.03 apart)."""
    path = str(files["Q4_1"])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    one = LLM(path, deterministic=True, **ENGINE)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    one.engine.shutdown()
    refs = hf_fp32_greedy(path, PROMPTS, NEW_TOKENS)
    two = LLM(path, deterministic=True, tp_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
        check(two, PROMPTS, refs, bf16_bound(path, refs), "Q4_1 TP=2 compiled bf16")
    finally:
        two.engine.shutdown()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> str:
    path = make_checkpoint(str(tmp_path_factory.mktemp("bf16")), "LlamaForCausalLM",
                           torch.bfloat16, **PACKED_SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (Path(path) / name).write_bytes((Path(demo_model_dir()) / name).read_bytes())
    return path


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_quantization_of_a_bf16_checkpoint(bf16_dir, quantization: str) -> None:
    """`--quantization`: every linear packed (I8 / I4), the embedding dense; the answers within
    the parity bound of transformers fp32 on the original weights for int8; int4 (3 bits of
    precision per weight) only checked to run and stay close in its top tokens."""
    refs = hf_fp32_greedy(bf16_dir, PROMPTS, NEW_TOKENS)
    llm = LLM(bf16_dir, enforce_eager=True, quantization=quantization, **ENGINE)
    weights = layer_weights(llm)
    fmt = {"int8": "I8x16", "int4": "I4x16"}[quantization]  # bf16 on the CPU: interleaved
    assert all(weights[k].format.name == fmt for k in ("qkv", "o", "gate_up", "down"))
    assert not isinstance(weights["embed"], PackedWeight)
    if quantization == "int8":
        check(llm, PROMPTS, refs, bf16_bound(bf16_dir, refs), "int8 eager bf16")
    else:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in out)
        first = [o.outputs[0].token_ids[0] for o in out]
        top = [set(r.logprobs[0].topk(5).indices.tolist()) for r in refs]
        assert sum(t in s for t, s in zip(first, top, strict=True)) >= len(PROMPTS) - 1


def test_quantization_none_dequantizes_a_gguf_file(files) -> None:
    llm = LLM(str(files["Q4_1"]), dtype="float32", enforce_eager=True, quantization="none",
              **ENGINE)
    assert not packed_formats(llm)


def test_an_unknown_quantization_is_refused(files) -> None:
    with pytest.raises(ValueError, match="unsupported quantization 'fp8'"):
        LLM(str(files["Q4_1"]), enforce_eager=True, quantization="fp8", **ENGINE)
