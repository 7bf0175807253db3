"""Packed weights: a linear's weight kept in its checkpoint's block-quantized format.

A `PackedWeight` holds the weight [N, K] as its N rows of blocks, byte for byte as a GGUF file
stores them (llama.cpp's layouts), plus the two formats of `--quantization` (group-wise
round-to-nearest with bf16 scales), or the same bits with 16 rows interleaved (below).
`ops.linear` takes one wherever it takes a weight tensor, and `ops.embedding` looks rows up in one.
Nothing is ever re-quantized: a weight's bits are the file's.

Formats (weights per block, bytes per block):
    Q8_0  32, 34    fp16 d, 32 x int8 q                      w = d q
    Q4_0  32, 18    fp16 d, 16 bytes of nibbles              w = d (q - 8)
    Q4_1  32, 20    fp16 d, fp16 m, nibbles                  w = d q + m
    Q5_0  32, 22    fp16 d, 32 high bits, nibbles            w = d (q - 16)
    Q5_1  32, 24    fp16 d, fp16 m, 32 high bits, nibbles    w = d q + m
    Q4_K  256, 144  fp16 d, dmin; 8 x 6-bit (scale, min); nibbles    w = d s_j q - dmin m_j
    Q5_K  256, 176  as Q4_K plus one high bit per weight
    Q6_K  256, 210  low nibbles, 2 high bits, 16 x int8 scales, fp16 d    w = d s_j (q - 32)
    I8    32, 34    bf16 d, 32 x int8 q (`--quantization int8`) w = d q
    I4    32, 18    bf16 d, nibbles (`--quantization int4`)    w = d (q - 8)

Every format also comes as `<name>x16`: the same blocks with 16 rows interleaved
(`kernels.interleave`: the same bits in another order; blocks [N / 16, 16 row_bytes]), the layout
the CPU kernel reads a vector of 16 output columns from. `ops.prepare_packed` chooses it at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the id the ops (and native/packed_linear.cpp) know the format by
    block: int  # weights per block
    nbytes: int  # bytes per block (of one row)
    rows: int = 1  # weight rows per group: 16 in an interleaved layout
    base: str = ""  # an interleaved format's base format

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block * self.nbytes


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q8_0", 0, 32, 34),
        BlockFormat("Q4_0", 1, 32, 18),
        BlockFormat("Q4_1", 2, 32, 20),
        BlockFormat("Q5_0", 3, 32, 22),
        BlockFormat("Q5_1", 4, 32, 24),
        BlockFormat("Q4_K", 5, 256, 144),
        BlockFormat("Q5_K", 6, 256, 176),
        BlockFormat("Q6_K", 7, 256, 210),
        BlockFormat("I8", 8, 32, 34),
        BlockFormat("I4", 9, 32, 18),
    )
}
INTERLEAVE_ROWS = 16
INTERLEAVED_CODE = 16  # an interleaved format's code: its base format's + 16
for _base in FORMATS.copy():
    _f = FORMATS[_base]
    FORMATS[f"{_base}x16"] = BlockFormat(f"{_base}x16", _f.code + INTERLEAVED_CODE, _f.block,
                                         _f.nbytes, INTERLEAVE_ROWS, _base)
BY_CODE: dict[int, BlockFormat] = {f.code: f for f in FORMATS.values()}


class PackedWeight(nn.Module):
    """A weight [out_features, in_features] as rows of `format`'s blocks: `blocks` [N, row_bytes]
    uint8 ([N / 16, 16 row_bytes] in an interleaved format). A module, so that its bytes are a
    buffer (moved, counted and seen by torch.compile as the model's other tensors are).

    A mixture-of-experts layer's experts are one stack of such weights, [E, out, in]: `blocks`
    [E, N, row_bytes] (each expert's rows interleaved on their own), `experts` E."""

    def __init__(self, blocks: torch.Tensor, format: BlockFormat, in_features: int) -> None:
        super().__init__()
        self.register_buffer("blocks", self._checked(blocks, format, in_features))
        self.in_features = in_features
        self._set_format(format)

    @staticmethod
    def _checked(blocks: torch.Tensor, format: BlockFormat, in_features: int) -> torch.Tensor:
        if in_features % format.block:
            raise ValueError(
                f"{format.name}: in_features={in_features} is not a multiple of its block "
                f"{format.block}"
            )
        if (blocks.dtype != torch.uint8 or blocks.dim() not in (2, 3)
                or blocks.shape[-1] != format.rows * format.row_bytes(in_features)):
            raise ValueError(
                f"{format.name}: blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of "
                f"{in_features} weights"
            )
        return blocks.contiguous()

    def _set_format(self, format: BlockFormat) -> None:
        self.format = format
        self.code = format.code
        self.out_features = self.blocks.shape[-2] * format.rows
        self.experts = self.blocks.shape[0] if self.blocks.dim() == 3 else 0

    def relayout(self, blocks: torch.Tensor, format: BlockFormat) -> None:
        """Hold the same weight in another layout (`ops.prepare_packed`), in place: a tied LM head
        shares this module with the embedding."""
        checked = self._checked(blocks, format, self.in_features)
        if checked.shape[:-2] != self.blocks.shape[:-2] or (
                checked.shape[-2] * format.rows != self.out_features):
            raise ValueError(f"{format.name}: blocks {tuple(checked.shape)} do not hold the "
                             f"weight {tuple(self.shape)}")
        self.blocks = checked
        self._set_format(format)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.blocks.shape[:-2], self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32 [N, K] (in row order, whatever the layout; [E, N, K] for experts)."""
        return dequantize_stack(self.blocks, self.code, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.format.name}, out_features={self.out_features}, in={self.in_features}"


def dequantize_stack(blocks: torch.Tensor, code: int, in_features: int) -> torch.Tensor:
    """Blocks [..., N or N / 16, row bytes] of format `code` -> fp32 [..., N, in_features], in row
    order whatever the layout (a stack of experts: each one's rows)."""
    rows = torch.ops.kernels.dequantize.default(blocks.reshape(-1, blocks.shape[-1]), code,
                                                in_features)
    return rows.view(*blocks.shape[:-2], -1, in_features)


def quantize(weight: torch.Tensor, format: BlockFormat) -> PackedWeight:
    """`--quantization`: weight [N, K] (or experts [E, N, K]) -> I8 or I4 blocks by round-to-nearest
    per group of 32 with a bf16 scale d = max|w| / qmax (qmax 127 or 7; the scale is rounded to bf16
    first, and the quants computed against the rounded scale)."""
    if format.name not in ("I8", "I4"):
        raise ValueError(f"quantize makes I8 or I4 blocks, not {format.name}")
    *lead, k = weight.shape
    n = weight.numel() // k
    groups = weight.detach().float().reshape(n, k // 32, 32)
    qmax = 127 if format.name == "I8" else 7
    d = (groups.abs().amax(-1, keepdim=True) / qmax).to(torch.bfloat16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1.0 / d.float())
    q = torch.round(groups * inv).clamp(-qmax, qmax).to(torch.int32)
    scale_bytes = d.view(torch.uint8).reshape(n, k // 32, 2)
    if format.name == "I8":
        quants = q.to(torch.int8).view(torch.uint8)
    else:
        u = (q + 8).to(torch.uint8)
        quants = u[..., :16] | (u[..., 16:] << 4)
    blocks = torch.cat([scale_bytes, quants], dim=-1).reshape(*lead, -1)
    return PackedWeight(blocks, format, k)
