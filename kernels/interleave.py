"""The interleaved layout of a packed weight: 16 rows' blocks regrouped so that a vector of 16 float
lanes holds 16 output columns (native/packed_linear_x16.cpp reads it). The same bytes in another
order, nothing re-quantized; `deinterleave` gives the file's blocks back.

For each group of 16 rows and each block j of 32 columns (formats with blocks of 32):

    scales   16 x 2 bytes     row c's scale (fp16, or bf16 for I8 / I4) at 2c
    mins     16 x 2 bytes     Q4_1 only: row c's min at 2c
    quants   8-bit: 16 chunks u of 32 bytes: byte 2c + i of chunk u is row c's quant 2u + i
             4-bit: 8 chunks t of 32 bytes: byte 2c + i of chunk t holds row c's quant 4t + i in
             its low nibble and quant 4t + 2 + i in its high one

so that a chunk widened to 16-bit words holds, for each of the 16 rows, one pair of neighbouring
quants (4-bit: the low nibbles one pair, the high nibbles the next).
"""

from __future__ import annotations

import torch

from kernels.packed import FORMATS, INTERLEAVE_ROWS, BlockFormat

ROWS = INTERLEAVE_ROWS


def _head_bytes(base: BlockFormat) -> int:
    """Bytes of a block before its quants: the fp16 / bf16 fields."""
    return base.nbytes - (32 if base.name in ("Q8_0", "I8") else 16)


def interleaved_format(fmt: BlockFormat) -> BlockFormat | None:
    """The interleaved form of `fmt` (None where it has none)."""
    return FORMATS.get(f"{fmt.name}x16")


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows [N, row_bytes] of `fmt` (N a multiple of 16) -> [N / 16, 16 row_bytes] of its
    interleaved format."""
    n, row_bytes = blocks.shape
    g, nb, head = n // ROWS, row_bytes // fmt.nbytes, _head_bytes(fmt)
    b = blocks.reshape(g, ROWS, nb, fmt.nbytes).transpose(1, 2)  # [g, nb, c, bytes]
    fields = b[..., :head].reshape(g, nb, ROWS, head // 2, 2).permute(0, 1, 3, 2, 4)
    qs = b[..., head:]
    if fmt.nbytes - head == 32:  # 8-bit: [c, u, i] -> [u, c, i]
        quants = qs.reshape(g, nb, ROWS, 16, 2).transpose(2, 3)
    else:  # 4-bit: values k = 4t + 2h + i -> byte (t, c, i), nibble h
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(g, nb, ROWS, 8, 2, 2)  # [c, t, h, i]
        q = q.permute(0, 1, 3, 2, 5, 4)  # [t, c, i, h]
        quants = q[..., 0] | (q[..., 1] << 4)
    return torch.cat([fields.reshape(g, nb, -1), quants.reshape(g, nb, -1)], dim=-1).reshape(g, -1)


def _rows(groups: torch.Tensor, fmt: BlockFormat, lane: torch.Tensor | None) -> torch.Tensor:
    """The file's blocks of each group's 16 rows [G, 16, row_bytes] (lane None), or of one row per
    group [G, row_bytes] (lane [G]: the row's place in its group)."""
    base = FORMATS[fmt.base]
    g = groups.shape[0]
    nb, head = groups.shape[1] // (ROWS * base.nbytes), _head_bytes(base)
    b = groups.reshape(g, nb, ROWS * base.nbytes)
    fields = b[..., : ROWS * head].reshape(g, nb, head // 2, ROWS, 2).permute(0, 3, 1, 2, 4)
    if base.nbytes - head == 32:  # [u, c, i] -> [c, u, i]
        quants = b[..., ROWS * head :].reshape(g, nb, 16, ROWS, 2).permute(0, 3, 1, 2, 4)
    else:  # byte (t, c, i) -> row c's bytes
        quants = b[..., ROWS * head :].reshape(g, nb, 8, ROWS, 2).permute(0, 3, 1, 2, 4)
    if lane is not None:
        picked = torch.arange(g, device=groups.device)
        fields, quants = fields[picked, lane], quants[picked, lane]
    if base.nbytes - head != 32:  # quants 4t + 2h + i -> the file's nibbles: k and k + 16 in a byte
        q = torch.stack([quants & 0xF, quants >> 4], dim=-2).flatten(-3)
        quants = q[..., :16] | (q[..., 16:] << 4)
    lead = fields.shape[:-2]
    out = torch.cat([fields.reshape(*lead, head), quants.reshape(*lead, -1)], dim=-1)
    return out.reshape(*lead[:-1], nb * base.nbytes)


def deinterleave(groups: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[N / 16, 16 row_bytes] of an interleaved format -> the base format's rows [N, row_bytes]."""
    return _rows(groups, fmt, None).reshape(groups.shape[0] * ROWS, -1)


def rows_of(groups: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """The base format's blocks of rows `ids` (any shape) of an interleaved weight:
    [*ids.shape, row_bytes]."""
    flat = ids.reshape(-1)
    out = _rows(groups[flat // ROWS], fmt, flat % ROWS)
    return out.reshape(*ids.shape, -1)
