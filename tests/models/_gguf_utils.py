"""GGUF files written from Hugging Face checkpoints as llama.cpp's converter writes them: its tensor
names, Q/K rows permuted for `llama`, 2-D weights in the chosen quantization type (norms and biases
stay F32), and the demo model's sentencepiece tokenizer (8000 pieces, a `llama` GGUF vocabulary)
with its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from compiled_engine.models.demo import _SPM_FILE, CHAT_TEMPLATE, DEMO_CONFIG

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TOKENIZER_VOCAB = DEMO_CONFIG["vocab_size"]


def permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute`: per head, rows (0, 1, ...) -> (0, half, 1, half + 1, ...)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    hf_dir: str, out: Path, qtype: gguf.GGMLQuantizationType, arch: str | None = None
) -> Path:
    """`out` (a .gguf file) holding the checkpoint in `hf_dir`; `arch` overrides
    `general.architecture`."""
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
    _copy_tokenizer(w)
    # tensor names and layout follow the model, whatever `arch` claims
    real = ARCHS[c["architectures"][0]]
    table = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[real], c["num_hidden_layers"]
    )
    for hf_name, t in load_file(str(Path(hf_dir, "model.safetensors"))).items():
        t = t.astype(np.float32)
        if real == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c["num_attention_heads"] if "q_proj" in hf_name else c["num_key_value_heads"]
            t = permute_rotary_rows(t, heads)
        tensor_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(t, qtype)
            w.add_tensor(tensor_name, data, raw_dtype=qtype)
        else:
            w.add_tensor(tensor_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


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
