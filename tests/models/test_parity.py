"""Our models against transformers on tiny random checkpoints: logits through a paged KV cache
(ragged prefill, chunked extend, batched decode) and greedy tokens."""

import pytest
import torch

from compiled_engine.models.loader import load_model
from tests.helpers.checkpoints import PagedKV, greedy, hf_greedy, hf_model, make_checkpoint, step

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-gqa-hd64": ("LlamaForCausalLM", {"head_dim": 64}),  # the AMX extend kernel in bf16
    "llama-tied-sharded-llama3rope": (
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE, "max_shard_size": "60KB"},
    ),
    "llama-mha-yarn": (
        "LlamaForCausalLM",
        {"num_key_value_heads": 4, "rope_parameters": YARN_ROPE},
    ),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "qwen2-sliding-layers": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3-qknorm": ("Qwen3ForCausalLM", {}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 8}),
}
PROMPTS = [
    list(range(3, 40)),
    [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83],
]
# max |logit error| / max |logit|; bf16 observed ~1.5e-2, the same as transformers bf16 vs fp32
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case: str, dtype: torch.dtype) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(str(tmp_path), arch, dtype, **overrides)
    model, config = load_model(path)
    assert model.dtype == dtype and config.architectures == [arch]
    hf = hf_model(path)
    extra = [[101, 102, 103, 104, 105], [201, 202, 203]]
    decode = [[5, 6, 7, 8], [9, 10, 11, 12]]
    full = [p + e + d for p, e, d in zip(PROMPTS, extra, decode, strict=True)]
    refs = [_hf_logits(hf, ids) for ids in full]
    worst = 0.0
    for page_size in (1, 16):
        kv = PagedKV(model, page_size, 64, 2)
        got = step(model, kv, PROMPTS, [0, 0]).split([len(p) for p in PROMPTS])  # ragged prefill
        pairs = [(g, r[: len(p)]) for g, r, p in zip(got, refs, PROMPTS, strict=True)]
        starts = [len(p) for p in PROMPTS]
        # extend after a cached prefix
        got = step(model, kv, extra, starts).split([len(e) for e in extra])
        pairs += [
            (g, r[s : s + len(e)]) for g, r, s, e in zip(got, refs, starts, extra, strict=True)
        ]
        starts = [s + len(e) for s, e in zip(starts, extra, strict=True)]
        for i in range(len(decode[0])):  # batched decode
            got = step(model, kv, [[d[i]] for d in decode], [s + i for s in starts])
            pairs += [(got[b], refs[b][starts[b] + i]) for b in range(2)]
        for g, r in pairs:
            worst = max(worst, ((g - r).abs().max() / r.abs().max()).item())
    print(f"max relative logit error {case} {dtype}: {worst:.2e}")
    assert worst < TOL[dtype]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers(tmp_path, case: str) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(str(tmp_path), arch, torch.float32, **overrides)
    model, _ = load_model(path)
    hf = hf_model(path)
    ours = greedy(model, PROMPTS, 64, page_size=16)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, 64)
