"""LoRA adapters in GGUF, as llama.cpp's `convert_lora_to_gguf.py` writes them: `general.type =
adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and per targeted weight `<name>.lora_a`
[r, in] and `<name>.lora_b` [out, r] under the base model's GGUF tensor names. For `llama` files
the rows of q's and k's B come permuted as the base weights do (llama.cpp's rotary layout): they are
put back in Hugging Face's order. A module's scaling is alpha / its rank (1 when alpha is 0), as
llama.cpp applies it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from compiled_engine.lora.weights import TARGET_MODULES, AdapterError, AdapterWeights
from compiled_engine.models.gguf_checkpoint import (
    PERMUTED_ARCHS,
    hf_tensor_names,
    unpermute_rotary_rows,
)

_BLOCK = re.compile(r"blk\.(\d+)\.")


def load_gguf_lora(path: str | Path, heads: dict[str, int], num_layers: int) -> AdapterWeights:
    """The adapter in GGUF file `path`; `heads`: the base model's attention heads of q_proj and
    k_proj (`LoRASlots.heads`); `num_layers`: its decoder layers (a block past them is refused
    before any name is looked up)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises several kinds on a damaged file
        raise AdapterError(f"{path}: not a readable GGUF file ({e})") from None

    def field(key: str) -> object:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a GGUF LoRA adapter (general.type "
                           f"{field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    arch = field("general.architecture")
    alpha = float(field("adapter.lora.alpha") or 0.0)
    blocks = 1 + max((int(m.group(1)) for t in reader.tensors
                      if (m := _BLOCK.match(t.name))), default=-1)
    if blocks > num_layers:
        raise AdapterError(f"{path}: a tensor of block {blocks - 1}, the model has {num_layers} "
                           "layers")
    try:
        names = hf_tensor_names(str(arch), blocks)
    except (KeyError, ValueError) as e:
        raise AdapterError(f"{path}: architecture {arch!r} is not served ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, which = t.name.rpartition(".")
        hf = names.get(base)
        if which not in ("lora_a", "lora_b") or hf is None:
            raise AdapterError(f"{path}: tensor {t.name!r} is not a LoRA A or B weight of a "
                               f"{arch} model")
        module = hf.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise AdapterError(f"{path}: {module!r} is not among the modules an adapter may "
                               f"target ({', '.join(TARGET_MODULES)})")
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise AdapterError(f"{path}: tensor {t.name!r} of type {t.tensor_type!r} cannot be "
                               f"read ({e})") from None
        shape = tuple(int(n) for n in reversed(t.shape))
        pairs.setdefault(module, {})[which] = torch.from_numpy(
            np.array(values, dtype=np.float32)).reshape(shape)
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: {module!r} has lora_a or lora_b but not both")
        a, b = pair["lora_a"], pair["lora_b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}")
        leaf = module.rsplit(".", 1)[-1]
        if arch in PERMUTED_ARCHS and leaf in heads:
            b = unpermute_rotary_rows(b, heads[leaf])
        rank = a.shape[0]
        modules[module] = (a, b * (alpha / rank if alpha else 1.0))
    if not modules:
        raise AdapterError(f"{path}: no LoRA weights")
    return AdapterWeights(max(a.shape[0] for a, _ in modules.values()), modules)
