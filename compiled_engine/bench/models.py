"""The bench checkpoint: a larger random Llama (hidden 768, 12 layers, vocab 32000, bf16) that every
benchmark loads, our engine and transformers alike.

Created deterministically on first use in `cache_root()/bench-llama-768` in Hugging Face layout. The
tokenizer is the demo one (8000 pieces) while the model's vocabulary is 32000: benchmarks use random
token ids, so only the embedding and LM-head sizes matter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

from compiled_engine.demo_model import cache_root, demo_model_dir, resolve_model

BENCH_NAME = "bench"
BENCH_DIR_NAME = "bench-llama-768"

BENCH_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "README.md")


def bench_model_dir(root: Path | None = None) -> Path:
    """Path of the bench checkpoint, creating it on first use."""
    target = (root or cache_root()) / BENCH_DIR_NAME
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-", dir=target.parent))
    try:
        write_bench_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent process won the race; its copy is identical
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_bench_model(model: str) -> str:
    """`bench` -> the bench checkpoint; otherwise as `--model` everywhere else ('demo' or a directory)."""
    return str(bench_model_dir()) if model == BENCH_NAME else resolve_model(model)


def bench_weights() -> dict:
    """Every tensor of the checkpoint (bf16), each from its own seeded generator."""
    import torch

    c = BENCH_CONFIG
    hidden, inter, vocab, head_dim = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
        tensors[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
    return tensors


def write_bench_model(out: Path) -> None:
    """Write the whole bench checkpoint into `out` (deterministic bytes)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    demo = demo_model_dir()
    for src in sorted(demo.iterdir()):
        if src.is_file() and src.name not in _CHECKPOINT_FILES:
            shutil.copyfile(src, out / src.name)
    tok_config = out / "tokenizer_config.json"
    if tok_config.exists():
        data = json.loads(tok_config.read_text())
        data["model_max_length"] = BENCH_CONFIG["max_position_embeddings"]
        _dump(tok_config, data)
    _dump(out / "config.json", BENCH_CONFIG)
    _dump(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2], "do_sample": False})
    save_file(bench_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        "# compiled-engine bench model (random weights)\n\nCreated by compiled_engine/bench/models.py.\n"
    )


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
