"""Copying (a rank's part of) a checkpoint tensor into a parameter.

`src` is a full checkpoint tensor: a torch.Tensor or a lazy safetensors slice
(`safe_open(...).get_slice`), so narrowing to this rank's part happens before anything is read or
copied.
"""

from typing import Any

import torch

WeightSource = Any  # torch.Tensor | safetensors PySafeSlice


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def check_shape(src: WeightSource, expected: tuple[int, ...]) -> None:
    if source_shape(src) != tuple(expected):
        raise ValueError(
            f"shape mismatch: checkpoint has {list(source_shape(src))}, model expects "
            f"{list(expected)}"
        )


def narrow(src: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    index = [slice(None)] * len(source_shape(src))
    index[dim] = slice(start, start + length)
    return src[tuple(index)]


def default_weight_loader(param: torch.Tensor, src: WeightSource, shard_id: Any = None) -> None:
    """A replicated parameter: the whole tensor on every rank."""
    check_shape(src, tuple(param.shape))
    param.data.copy_(src[:])
