"""Which tensor-parallel sizes a model's shapes allow (as `layers.linear` shards them), checked
before any rank starts so that a wrong `--tp` is one clear line, not a traceback per rank. The
shapes are read from the checkpoint's config.json or GGUF metadata as plain data (no torch: the
server's process checks too)."""

from __future__ import annotations

import json
from pathlib import Path

from compiled_engine.models.demo import DEMO_CONFIG, DEMO_NAME
from compiled_engine.models.errors import CheckpointError
from compiled_engine.models.gguf_checkpoint import is_gguf, open_gguf
from compiled_engine.models.names import resolve_model


def _misfit(config: dict, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model (None if they can): query heads and the MLP's
    intermediate size split evenly; KV heads split evenly or are replicated (`tp` a multiple of
    them)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % tp:
        return f"num_attention_heads={heads} is not divisible by {tp}"
    if kv_heads % tp and tp % kv_heads:
        return f"num_key_value_heads={kv_heads} neither divides nor is divisible by {tp}"
    if config["intermediate_size"] % tp:
        return f"intermediate_size={config['intermediate_size']} is not divisible by {tp}"
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(name) and config[name] % tp:  # mixture of experts: each expert's is split
            return f"{name}={config[name]} is not divisible by {tp}"
    return None


def tp_sizes(config: dict) -> list[int]:
    """Every tensor-parallel size this model (its config as a dict) can run at."""
    return [tp for tp in range(1, config["num_attention_heads"] + 1) if _misfit(config, tp) is None]


def model_shape(model: str) -> dict:
    """The config (a dict) of the model `--model` names; the demo's without writing its
    checkpoint."""
    if model == DEMO_NAME:
        return DEMO_CONFIG
    path = resolve_model(model)
    if is_gguf(path):
        return open_gguf(path).config_dict
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the config of {path}: {e}") from e
    if not {"num_attention_heads", "intermediate_size"} <= config.keys():
        raise CheckpointError(
            f"{path}/config.json: num_attention_heads and intermediate_size are required"
        )
    return config


def check_tp_size(model: str, tp: int) -> None:
    """ValueError (one line naming the valid sizes) unless the model `--model` names fits `tp`
    ranks."""
    if tp < 1:
        raise ValueError(f"--tp {tp}: the tensor-parallel size must be >= 1")
    if tp == 1:
        return
    config = model_shape(model)
    why = _misfit(config, tp)
    if why is not None:
        valid = ", ".join(map(str, tp_sizes(config)))
        raise ValueError(
            f"--tp {tp} does not fit {model}: {why}; valid --tp values for this model: {valid}"
        )
