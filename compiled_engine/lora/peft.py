"""Adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors` (or `.bin` is
refused: it is a pickle) as `PeftModel.save_pretrained` writes them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from compiled_engine.lora.folder import PEFT_FILES
from compiled_engine.lora.weights import TARGET_MODULES, AdapterError, AdapterWeights

_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def load_peft(path: str | Path) -> AdapterWeights:
    """The adapter in folder `path`; AdapterError names what is wrong with it."""
    folder = Path(path)
    config_file, tensors_file = (folder / name for name in PEFT_FILES)
    if not config_file.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter's folder?)")
    if not tensors_file.is_file():
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_file}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file}: not a JSON object")
    rank, scaling = _check_config(config, config_file)
    try:
        tensors = load_file(tensors_file)
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds on a damaged file
        raise AdapterError(f"{tensors_file}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name.removeprefix(_PREFIX))
        if match is None:
            raise AdapterError(f"{tensors_file}: tensor {name!r} is not a LoRA A or B weight")
        module, which = match.groups()
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise AdapterError(f"{tensors_file}: {module!r} is not among the modules an adapter "
                               f"may target ({', '.join(TARGET_MODULES)})")
        pairs.setdefault(module, {})[which] = tensor
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{tensors_file}: {module!r} has lora_A or lora_B but not both")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{tensors_file}: {module!r} has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}, not [r, in] and [out, r] with r = {rank}")
        b = b * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{tensors_file}: {module!r} holds NaN or infinite values (its "
                               f"lora_A, or its lora_B scaled by {scaling})")
        modules[module] = (a, b)
    if not modules:
        raise AdapterError(f"{tensors_file}: no LoRA weights")
    return AdapterWeights(rank, modules)


def _check_config(config: dict, where: Path) -> tuple[int, float]:
    """The adapter's rank and scaling; AdapterError for what this engine does not serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} (only LORA is served)")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for field, served in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(field, served) != served:
            raise AdapterError(f"{where}: {field}={config[field]!r} is not served "
                               f"(only {served!r})")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
                  "trainable_token_indices"):
        if config.get(field):
            raise AdapterError(f"{where}: {field} is not served")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling
