"""GGUF files written from Hugging Face checkpoints as llama.cpp's converter writes them: its tensor
names, Q/K rows permuted for `llama`, 2-D weights in the chosen quantization type (norms and biases
stay F32), and the demo model's sentencepiece tokenizer (8000 pieces, a `llama` GGUF vocabulary)
with its chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from compiled_engine.models.demo import _SPM_FILE, CHAT_TEMPLATE, DEMO_CONFIG

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Qwen3MoeForCausalLM": "qwen3moe"}
TOKENIZER_VOCAB = DEMO_CONFIG["vocab_size"]


def permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute`: per head, rows (0, 1, ...) -> (0, half, 1, half + 1, ...)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    hf_dir: str,
    out: Path,
    qtype: gguf.GGMLQuantizationType,
    arch: str | None = None,
    mix: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """`out` (a .gguf file) holding the checkpoint in `hf_dir`; `arch` overrides
    `general.architecture`; `mix` gives the type of the 2-D tensors whose Hugging Face name
    contains a key (as a Q4_K_M file holds its v projections in Q6_K)."""
    c = json.loads(Path(hf_dir, "config.json").read_text())
    name = arch or ARCHS[c["architectures"][0]]
    w = gguf.GGUFWriter(str(out), name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(
        c.get("rope_parameters", {}).get("rope_theta") or c.get("rope_theta", 10000.0)
    )
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(int(qtype))
    experts = c.get("num_experts") or c.get("num_local_experts")  # transformers 5 writes the latter
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    _copy_tokenizer(w)
    # tensor names and layout follow the model, whatever `arch` claims
    real = ARCHS[c["architectures"][0]]
    table = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[real], c["num_hidden_layers"]
    )
    for hf_name, t in _stacked_experts(load_file(str(Path(hf_dir, "model.safetensors")))).items():
        t = t.astype(np.float32)
        if real == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c["num_attention_heads"] if "q_proj" in hf_name else c["num_key_value_heads"]
            t = permute_rotary_rows(t, heads)
        tensor_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        kind = next((q for key, q in (mix or {}).items() if key in hf_name), qtype)
        if hf_name.endswith("mlp.gate.weight"):  # llama.cpp keeps a MoE router in F32
            kind = gguf.GGMLQuantizationType.F32
        if t.ndim >= 2 and kind != gguf.GGMLQuantizationType.F32:
            rows = quantize(t.reshape(-1, t.shape[-1]), kind)
            w.add_tensor(tensor_name, rows.reshape(*t.shape[:-1], -1), raw_dtype=kind)
        else:
            w.add_tensor(tensor_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _stacked_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """As llama.cpp's converter writes a mixture of experts: each layer's experts stacked into one
    [E, ...] tensor per projection (`...mlp.experts.gate_proj.weight`)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def quantize(t: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """[N, K] fp32 -> the GGUF type's bytes [N, row bytes]: the `gguf` package's quantizer where
    it has one; for Q4_K, Q5_K and Q6_K (which it only dequantizes) a round-to-nearest one of
    ours, in llama.cpp's block layouts."""
    k_quant = {gguf.GGMLQuantizationType.Q4_K: _q4_k, gguf.GGMLQuantizationType.Q5_K: _q5_k,
               gguf.GGMLQuantizationType.Q6_K: _q6_k}
    if qtype in k_quant:
        return k_quant[qtype](t.reshape(t.shape[0], -1, 256)).reshape(t.shape[0], -1)
    return gguf.quants.quantize(t, qtype)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], 2)


def _affine_k(x: np.ndarray, levels: int):
    """Q4_K / Q5_K: per sub-block of 32 a scale and a min in 6 bits under the super-block's fp16
    d and dmin; x [..., 256] -> (d, dmin, 6-bit scales [..., 8], mins [..., 8], quants [..., 8,
    32])."""
    sub = x.reshape(*x.shape[:-1], 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = np.abs((-lo).max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63)
    step = (d * sc)[..., None]
    q = np.divide(sub + (dmin * m)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), np.clip(np.round(q), 0, levels)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The inverse of llama.cpp's get_scale_min_k4: 8 scales and 8 mins (6 bits) -> 12 bytes."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return out


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Quants [..., 8, 32] -> 128 bytes: chunk i holds sub-block 2i low, 2i + 1 high."""
    q = q.astype(np.uint8) & 0xF
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:-2], 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m),
                           _nibble_pairs(q)], -1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 31)
    q = q.astype(np.uint8)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), qh,
                           _nibble_pairs(q)], -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Per 16 weights an int8 scale under the fp16 d; quants q - 32 in [-32, 31]."""
    sub = x.reshape(*x.shape[:-1], 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 127)
    step = (d * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(*x.shape[:-1], 2, 4, 32)
    ql = np.concatenate([(q[..., 0, :] & 0xF) | ((q[..., 2, :] & 0xF) << 4),
                         (q[..., 1, :] & 0xF) | ((q[..., 3, :] & 0xF) << 4)], -1)
    qh = sum((q[..., g, :] >> 4) << (2 * g) for g in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(*x.shape[:-1], 128), qh.reshape(*x.shape[:-1], 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], -1)


def _copy_tokenizer(w: gguf.GGUFWriter) -> None:
    """The demo's sentencepiece vocabulary as llama.cpp writes one (pieces, scores, token types)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(_SPM_FILE))
    t = gguf.TokenType
    kinds = [
        t.UNKNOWN
        if sp.is_unknown(i)
        else t.CONTROL
        if sp.is_control(i)
        else t.BYTE
        if sp.is_byte(i)
        else t.NORMAL
        for i in range(sp.get_piece_size())
    ]
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types(kinds)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
