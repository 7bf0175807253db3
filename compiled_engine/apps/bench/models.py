"""The bench checkpoint: a larger random Llama (hidden 768, 12 layers, vocab 32000, bf16) that every
benchmark loads, our engine and transformers alike.

Created deterministically on first use in `cache_root()/bench-llama-768` in Hugging Face layout. The
tokenizer is the demo one (8000 pieces) while the model's vocabulary is 32000: benchmarks use random
token ids, so only the embedding and LM-head sizes matter.
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

_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "README.md")


def bench_model_dir(root: Path | None = None) -> Path:
    """Path of the bench checkpoint, creating it on first use."""
    return cached_folder((root or cache_root()) / BENCH_DIR_NAME, write_bench_model)


def resolve_bench_model(model: str) -> str:
    """`bench` -> the bench checkpoint; otherwise as `--model` everywhere else."""
    return str(bench_model_dir()) if model == BENCH_NAME else resolve_model(model)


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
        dump_json(tok_config, data)
    dump_json(out / "config.json", BENCH_CONFIG)
    dump_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2], "do_sample": False})
    save_file(random_llama_weights(BENCH_CONFIG, "bfloat16"), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        "# compiled-engine bench model (random weights)\n\nCreated by compiled_engine/apps/bench/models.py.\n"
    )
