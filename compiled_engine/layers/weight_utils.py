"""Copying (a rank's part of) a checkpoint tensor into a parameter.

`src` is a full checkpoint tensor: a torch.Tensor, a lazy safetensors slice
(`safe_open(...).get_slice`), so narrowing to this rank's part happens before anything is read or
copied, or a `PackedSource` (a GGUF tensor kept in its block format), which the linear and
embedding layers keep packed and every other loader dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.packed import BlockFormat, PackedWeight

WeightSource = Any  # torch.Tensor | safetensors PySafeSlice | PackedSource


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor | PackedSource) else tuple(
        src.get_shape())


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
    """A replicated parameter: the whole tensor on every rank (a packed one dequantized)."""
    check_shape(src, tuple(param.shape))
    param.data.copy_(dense(src))


def dense(src: WeightSource) -> torch.Tensor:
    """The source as a plain tensor: a packed one dequantized (fp32), others read."""
    return src.dequantize() if isinstance(src, PackedSource) else src[:]


@dataclass(frozen=True)
class PackedSource:
    """A checkpoint weight [N, K] kept in a block format (`kernels.packed`): `blocks` [N, row bytes]
    uint8. Narrowing keeps it packed: rows freely, columns at block boundaries only."""

    blocks: torch.Tensor
    format: BlockFormat
    shape: tuple[int, int]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple[slice, ...] | slice) -> PackedSource:
        rows, cols = (index, slice(None)) if isinstance(index, slice) else (*index, slice(None))[:2]
        n0, n1, _ = rows.indices(self.shape[0])
        k0, k1, _ = cols.indices(self.shape[1])
        if k0 % self.format.block or k1 % self.format.block:
            raise ValueError(
                f"{self.format.name} columns {k0}:{k1} do not fall on its blocks of "
                f"{self.format.block}"
            )
        b0, b1 = k0 // self.format.block, -(-k1 // self.format.block)
        cut = self.blocks[n0:n1, b0 * self.format.nbytes : b1 * self.format.nbytes]
        return PackedSource(cut, self.format, (n1 - n0, k1 - k0))

    def splits_at(self, dim: int, length: int) -> bool:
        """Whether a narrowing of `length` along `dim` keeps whole blocks."""
        return dim == 0 or length % self.format.block == 0

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32."""
        return PackedWeight(self.blocks, self.format, self.shape[1]).dequantize()

    def packed(self) -> PackedWeight:
        return PackedWeight(self.blocks.clone(), self.format, self.shape[1])
