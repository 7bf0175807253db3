"""The bench checkpoints, random weights that every benchmark loads, our engine and transformers
alike: `bench`, a larger Llama (hidden 768, 12 layers, vocab 32000, bf16), and `qwen3-0.6b`,
Qwen3-0.6B's shape (28 layers, hidden 1024, GQA 16/8, head dim 128, vocab 151936, bf16: nano-vllm's
GPU benchmark model).

Created deterministically on first use under `cache_root()` in Hugging Face layout. The tokenizer is
the demo one (8000 pieces) whatever the model's vocabulary: benchmarks use random token ids, so only
the embedding and LM-head sizes matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from compiled_engine.models.demo import (
    DEMO_CONFIG,
    cache_root,
    cached_folder,
    demo_model_dir,
    dump_json,
    random_llama_weights,
)
from compiled_engine.models.names import resolve_model

BENCH_NAME = "bench"
BENCH_DIR_NAME = "bench-llama-768"

BENCH_CONFIG = DEMO_CONFIG | {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

QWEN3_NAME = "qwen3-0.6b"
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# A Qwen3-MoE of SmolLM2-135M's active size: its shape (hidden 576, 30 layers, GQA 9/3, vocab
# 49152), every layer routed to 2 of 8 experts of intermediate 768 (the active MLP is SmolLM2's 1536
# wide)
QWEN3_MOE_NAME = "qwen3-moe"
QWEN3_MOE_CONFIG = QWEN3_CONFIG | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
BENCH_MODELS = {
    BENCH_NAME: (BENCH_DIR_NAME, BENCH_CONFIG),
    QWEN3_NAME: ("bench-qwen3-0.6b", QWEN3_CONFIG),
    QWEN3_MOE_NAME: ("bench-qwen3-moe", QWEN3_MOE_CONFIG),
}

_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "README.md")


def bench_model_dir(root: Path | None = None, name: str = BENCH_NAME) -> Path:
    """Path of a bench checkpoint, creating it on first use."""
    folder, config = BENCH_MODELS[name]
    return cached_folder(
        (root or cache_root()) / folder, lambda out: write_bench_model(out, config)
    )


def resolve_bench_model(model: str) -> str:
    """A bench model's name -> its checkpoint; otherwise as `--model` everywhere else."""
    return str(bench_model_dir(name=model)) if model in BENCH_MODELS else resolve_model(model)


def write_bench_model(out: Path, config: dict = BENCH_CONFIG) -> None:
    """Write a whole bench checkpoint into `out` (deterministic bytes)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    demo = demo_model_dir()
    for src in sorted(demo.iterdir()):
        if src.is_file() and src.name not in _CHECKPOINT_FILES:
            shutil.copyfile(src, out / src.name)
    tok_config = out / "tokenizer_config.json"
    if tok_config.exists():
        data = json.loads(tok_config.read_text())
        data["model_max_length"] = config["max_position_embeddings"]
        dump_json(tok_config, data)
    dump_json(out / "config.json", config)
    dump_json(
        out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2], "do_sample": False}
    )
    save_file(
        random_llama_weights(config, "bfloat16"),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "README.md").write_text(
        "# compiled-engine bench model (random weights)\n\nCreated by "
        "benchmarks/models.py.\n"
    )
