"""Which tensor-parallel sizes a model's shapes allow (as `layers.linear` shards them), checked before any rank
starts so that a wrong `--tp` is one clear line, not a traceback per rank."""

from __future__ import annotations

from transformers import PretrainedConfig

from compiled_engine.models.loader import load_config
from compiled_engine.models.names import resolve_model


def _misfit(config: PretrainedConfig, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model (None if they can): query heads and the MLP's intermediate size
    split evenly; KV heads split evenly or are replicated (`tp` a multiple of them)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp:
        return f"num_attention_heads={heads} is not divisible by {tp}"
    if kv_heads % tp and tp % kv_heads:
        return f"num_key_value_heads={kv_heads} neither divides nor is divisible by {tp}"
    if config.intermediate_size % tp:
        return f"intermediate_size={config.intermediate_size} is not divisible by {tp}"
    return None


def tp_sizes(config: PretrainedConfig) -> list[int]:
    """Every tensor-parallel size this model can run at."""
    return [tp for tp in range(1, config.num_attention_heads + 1) if _misfit(config, tp) is None]


def check_tp_size(model: str, tp: int) -> None:
    """ValueError (one line naming the valid sizes) unless the model `--model` names fits `tp` ranks."""
    if tp < 1:
        raise ValueError(f"--tp {tp}: the tensor-parallel size must be >= 1")
    if tp == 1:
        return
    config = load_config(resolve_model(model))
    why = _misfit(config, tp)
    if why is not None:
        valid = ", ".join(map(str, tp_sizes(config)))
        raise ValueError(f"--tp {tp} does not fit {model}: {why}; valid --tp values for this model: {valid}")
