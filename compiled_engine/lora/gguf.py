"""LoRA adapters in GGUF, as llama.cpp's `convert_lora_to_gguf.py` writes them: `general.type =
adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and per targeted weight `<name>.lora_a`
[r, in] and `<name>.lora_b` [out, r] under the base model's GGUF tensor names. For `llama` files
the rows of q's and k's B come permuted as the base weights do (llama.cpp's rotary layout): they are
put back in Hugging Face's order. A module's scaling is alpha / its rank (1 when alpha is 0), as
llama.cpp applies it.

The header is read within bounds and its layout checked (`gguf_bounds`), then every tensor's name
and shape against the model's projections and rank limit, all before any tensor's data is read;
then each tensor's own bytes are read once, and non-finite values refused."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from compiled_engine.lora.gguf_bounds import TensorInfo, read_header
from compiled_engine.lora.weights import (
    TARGET_MODULES,
    AdapterError,
    AdapterTargets,
    AdapterWeights,
)
from compiled_engine.models.gguf_checkpoint import (
    PERMUTED_ARCHS,
    hf_tensor_names,
    unpermute_rotary_rows,
)

_BLOCK = re.compile(r"blk\.(\d+)\.")


def load_gguf_lora(path: str | Path, targets: AdapterTargets) -> AdapterWeights:
    """The adapter in GGUF file `path`, checked against `targets` before its data is read."""
    where = str(path)
    with open(path, "rb") as f:
        meta = (header := read_header(f, where)).metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise AdapterError(f"{where}: not a GGUF LoRA adapter (general.type "
                               f"{meta.get('general.type')!r:.100}, adapter.type "
                               f"{meta.get('adapter.type')!r:.100})")
        arch = meta.get("general.architecture")
        alpha = meta.get("adapter.lora.alpha", 0.0)
        if not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise AdapterError(f"{where}: adapter.lora.alpha {alpha!r:.100} is not a finite number")
        modules = {}
        for module, (a_info, b_info) in _pairs(header.tensors, arch, targets, where).items():
            a, b = _values(f, a_info, where), _values(f, b_info, where)
            leaf = module.rsplit(".", 1)[-1]
            if arch in PERMUTED_ARCHS and leaf in targets.heads:
                b = unpermute_rotary_rows(b, targets.heads[leaf])
            scaling = alpha / a.shape[0] if alpha else 1.0
            b = b * scaling
            if not torch.isfinite(b).all():
                raise AdapterError(f"{where}: {b_info.name!r} scaled by alpha / rank ({scaling}) "
                                   "is not finite")
            modules[module] = (a, b)
    if not modules:
        raise AdapterError(f"{where}: no LoRA weights")
    return AdapterWeights(max(a.shape[0] for a, _ in modules.values()), modules)


def _pairs(tensors: list[TensorInfo], arch: object, targets: AdapterTargets,
           where: str) -> dict[str, tuple[TensorInfo, TensorInfo]]:
    """Each targeted module's A and B, their names and shapes checked against the model's
    projections and the rank limit."""
    blocks = 1 + max((int(m.group(1)) for t in tensors if (m := _BLOCK.match(t.name))),
                     default=-1)
    if blocks > targets.num_layers:
        raise AdapterError(f"{where}: a tensor of block {blocks - 1}, the model has "
                           f"{targets.num_layers} layers")
    try:
        names = hf_tensor_names(str(arch), blocks)
    except (KeyError, ValueError) as e:
        raise AdapterError(f"{where}: architecture {arch!r:.100} is not served ({e!s:.100})"
                           ) from None
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for t in tensors:
        base, _, which = t.name.rpartition(".")
        hf = names.get(base)
        if which not in ("lora_a", "lora_b") or hf is None:
            raise AdapterError(f"{where}: tensor {t.name!r} is not a LoRA A or B weight of a "
                               f"{arch} model")
        module = hf.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise AdapterError(f"{where}: {module!r} is not among the modules an adapter may "
                               f"target ({', '.join(TARGET_MODULES)})")
        if module not in targets.projections:
            raise AdapterError(f"{where}: targets {module!r}, which this model does not have (or "
                               "serves no adapter on)")
        if len(t.shape) != 2:
            raise AdapterError(f"{where}: tensor {t.name!r} has shape {list(t.shape)}, not 2-D")
        pairs.setdefault(module, {})[which] = t
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{where}: {module!r} has lora_a or lora_b but not both")
        a, b = pair["lora_a"], pair["lora_b"]
        (rank, fan_in), (fan_out, b_rank) = a.shape, b.shape
        if rank != b_rank:
            raise AdapterError(f"{where}: {module!r} has A {list(a.shape)} and B {list(b.shape)}")
        full_in, full_out = targets.projections[module]
        if (fan_in, fan_out) != (full_in, full_out):
            raise AdapterError(f"{where}: {module!r} maps {fan_in} -> {fan_out} features, the "
                               f"model's projection {full_in} -> {full_out}")
        if rank > targets.max_rank:
            raise AdapterError(f"{where}: {module!r} has rank {rank}, above the server's "
                               f"--max-lora-rank {targets.max_rank}")
        out[module] = (a, b)
    return out


def _values(f: BinaryIO, t: TensorInfo, where: str) -> torch.Tensor:
    """Tensor `t`'s values in fp32, read from its own bytes; AdapterError for NaN or infinities."""
    import gguf

    raw = bytearray(t.nbytes)
    f.seek(t.offset)
    if f.readinto(raw) != t.nbytes:
        raise AdapterError(f"{where}: tensor {t.name!r} is cut short (the file changed?)")
    rows = np.frombuffer(raw, np.uint8).reshape(math.prod(t.shape[:-1]), -1)
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(t.type_id))
    tensor = torch.from_numpy(np.asarray(values, np.float32)).reshape(t.shape)
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"{where}: tensor {t.name!r} holds NaN or infinite values")
    return tensor
