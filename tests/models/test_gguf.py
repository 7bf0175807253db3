"""GGUF checkpoints: files written from random Hugging Face checkpoints as llama.cpp writes them
(F32, F16, Q8_0, Q4_0) load into the engine with transformers' greedy tokens and log-probabilities
on the same file (transformers dequantizes through the same `gguf` routines, so fp32 agrees to
rounding); bad files give a `CheckpointError` naming the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest
import torch
from _gguf_utils import TOKENIZER_VOCAB, write_gguf

from compiled_engine import LLM, SamplingParams
from compiled_engine.models.loader import CheckpointError, load_model
from compiled_engine.models.names import resolve_model
from compiled_engine.tokenization import load_tokenizer
from tests.helpers.checkpoints import MOE, make_checkpoint

Q = gguf.GGMLQuantizationType
# Rows of 32-value blocks (Q8_0 / Q4_0), the tokenizer's vocabulary. Qwen3's head_dim is its
# default, 128: transformers' GGUF reader ignores `qwen3.attention.key_length` and takes the config
# default.
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    vocab_size=TOKENIZER_VOCAB,
    num_hidden_layers=2,
)
HEAD_DIM = {"Qwen3ForCausalLM": 128}
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch,
                                  **SHAPE | {"head_dim": HEAD_DIM.get(arch, SHAPE["head_dim"])})
            for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}


def hf_greedy(
    path: Path, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers on the GGUF file (fp32): greedy tokens and the log-probability of each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids, lps = list(prompt), []
            for _ in range(steps):
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
                ids.append(int(lp.argmax()))
                lps.append(float(lp.max()))
            tokens.append(ids[len(prompt):])
            logprobs.append(lps)
    return tokens, logprobs


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_gguf_greedy_matches_transformers(hf_dirs, tmp_path: Path, arch: str, qtype: Q) -> None:
    path = write_gguf(hf_dirs[arch], tmp_path / f"model-{qtype.name}.gguf", qtype)
    assert_matches_transformers(path, arch)


def assert_matches_transformers(path: Path, arch: str) -> None:
    """The engine (eager fp32) on the GGUF file: the model class `arch`, and transformers' greedy
    tokens and log-probabilities on the same file."""
    llm = LLM(str(path), dtype="float32", enforce_eager=True, num_pages=512, max_running=4)
    assert type(llm.engine.model).__name__ == arch
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    tokens, logprobs = hf_greedy(path, prompts, GREEDY.max_tokens)
    outputs = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    assert [o.token_ids for o in outputs] == tokens
    for out, expected in zip(outputs, logprobs):
        assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_gguf_auto_dtype_and_folder(hf_dirs, tmp_path: Path) -> None:
    """`dtype="auto"`: an all-F32 file loads in fp32, a quantized one in bf16; a folder holding one
    file names it."""
    (tmp_path / "f32").mkdir()
    f32 = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "f32" / "m.gguf", Q.F32)
    q8 = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "q8.gguf", Q.Q8_0)
    assert load_model(str(f32))[0].dtype == torch.float32
    assert load_model(str(q8))[0].dtype == torch.bfloat16
    assert resolve_model(str(f32.parent)) == str(f32)
    tokenizer = load_tokenizer(str(q8))
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        == "<s><|user|>\nHi</s>\n"
    )
    ids = tokenizer("Hello world, 42 times").input_ids
    assert (
        ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "Hello world, 42 times"
    )


def test_truncated_file(hf_dirs, tmp_path: Path) -> None:
    path = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "m.gguf", Q.Q8_0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(str(path))


def test_unknown_architecture(hf_dirs, tmp_path: Path) -> None:
    path = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "m.gguf", Q.F16, arch="falcon")
    with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported"):
        load_model(str(path))


def test_unknown_quantization_type(hf_dirs, tmp_path: Path) -> None:
    """A tensor whose type id no GGML version defines (patched into the file's tensor table)."""
    path = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "m.gguf", Q.F32)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unsupported quantization type"):
        load_model(str(path))


def test_missing_metadata_key(hf_dirs, tmp_path: Path) -> None:
    path = write_gguf(hf_dirs["LlamaForCausalLM"], tmp_path / "m.gguf", Q.F32)
    data = path.read_bytes().replace(b"llama.block_count", b"llama.block_kount")
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="'llama.block_count' is missing"):
        load_model(str(path))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_qwen3moe_matches_transformers(tmp_path: Path, qtype: Q) -> None:
    """A `qwen3moe` file as llama.cpp writes one (each layer's experts stacked per projection, every
    layer routed): the engine's Qwen3-MoE equals transformers on the same file. The experts'
    intermediate size is Qwen3-MoE's default, 768: transformers' GGUF reader ignores
    `qwen3moe.expert_feed_forward_length` and takes the config default (the engine reads it)."""
    hf_dir = make_checkpoint(str(tmp_path / "hf"), "Qwen3MoeForCausalLM",
                             **SHAPE | MOE | {"mlp_only_layers": [], "norm_topk_prob": True,
                                              "moe_intermediate_size": 768})
    path = write_gguf(hf_dir, tmp_path / f"moe-{qtype.name}.gguf", qtype)
    assert_matches_transformers(path, "Qwen3MoeForCausalLM")
