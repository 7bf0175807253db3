"""The interleaved layout of a packed weight: 16 rows' blocks regrouped so that a vector of 16 float
lanes holds 16 output columns (native/packed_linear_x16.cpp reads it). The same bits in another
order, nothing re-quantized; `deinterleave` gives the file's blocks back.

For each group of 16 rows and each block j of 32 columns (formats with blocks of 32):

    scales   16 x 2 bytes     row c's scale (fp16, or bf16 for I8 / I4) at 2c
    mins     16 x 2 bytes     Q4_1, Q5_1: row c's min at 2c
    masks    16 x 4 bytes     Q5_0, Q5_1: the fifth bits, one 32-bit mask per 4-bit half-chunk
                              (t, h) at 8t + 4h: its bit 2c + i is row c's bit of quant 4t + 2h + i
    quants   8-bit: 16 chunks u of 32 bytes: byte 2c + i of chunk u is row c's quant 2u + i
             4-bit: 8 chunks t of 32 bytes: byte 2c + i of chunk t holds row c's quant 4t + i in
             its low nibble and quant 4t + 2 + i in its high one (Q5: their low four bits)

so that a chunk widened to 16-bit words holds, for each of the 16 rows, one pair of neighbouring
quants (4-bit: the low nibbles one pair, the high nibbles the next; a mask sets their fifth bits).
"""

from __future__ import annotations

import torch

from kernels.packed import FORMATS, INTERLEAVE_ROWS, BlockFormat

ROWS = INTERLEAVE_ROWS


def _head_bytes(base: BlockFormat) -> int:
    """Bytes of a block's fp16 / bf16 fields (the file's high bits of Q5_0 / Q5_1 follow them)."""
    return 4 if base.name in ("Q4_1", "Q5_1") else 2


def _high_bits(base: BlockFormat) -> bool:
    return base.name in ("Q5_0", "Q5_1")


def _bits_le(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> their bits [..., 8 n], little endian."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _pack_le(bits: torch.Tensor) -> torch.Tensor:
    """Bits [..., 8 n] (0 / 1, uint8) -> bytes [..., n], little endian."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    by = bits.reshape(*bits.shape[:-1], -1, 8) << shifts
    return by.sum(-1, dtype=torch.uint8)


def interleaved_format(fmt: BlockFormat) -> BlockFormat | None:
    """The interleaved form of `fmt` (None where it has none)."""
    return FORMATS.get(f"{fmt.name}x16")


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows [N, row_bytes] of `fmt` (N a multiple of 16) -> [N / 16, 16 row_bytes] of its
    interleaved format."""
    n, row_bytes = blocks.shape
    g, nb, head = n // ROWS, row_bytes // fmt.nbytes, _head_bytes(fmt)
    b = blocks.reshape(g, ROWS, nb, fmt.nbytes).transpose(1, 2)  # [g, nb, c, bytes]
    parts = [b[..., :head].reshape(g, nb, ROWS, head // 2, 2).permute(0, 1, 3, 2, 4)]
    qs = b[..., fmt.nbytes - 32 :] if fmt.name in ("Q8_0", "I8") else b[..., fmt.nbytes - 16 :]
    if _high_bits(fmt):  # bit of quant k = 4t + 2h + i -> mask (t, h), bit 2c + i
        bits = _bits_le(b[..., head : head + 4]).reshape(g, nb, ROWS, 8, 2, 2)  # [c, t, h, i]
        parts.append(_pack_le(bits.permute(0, 1, 3, 4, 2, 5).reshape(g, nb, 8, 2, 32)))
    if fmt.name in ("Q8_0", "I8"):  # [c, u, i] -> [u, c, i]
        parts.append(qs.reshape(g, nb, ROWS, 16, 2).transpose(2, 3))
    else:  # 4-bit: values k = 4t + 2h + i -> byte (t, c, i), nibble h
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(g, nb, ROWS, 8, 2, 2)  # [c, t, h, i]
        q = q.permute(0, 1, 3, 2, 5, 4)  # [t, c, i, h]
        parts.append(q[..., 0] | (q[..., 1] << 4))
    return torch.cat([p.reshape(g, nb, -1) for p in parts], dim=-1).reshape(g, -1)


def _rows(groups: torch.Tensor, fmt: BlockFormat, lane: torch.Tensor | None) -> torch.Tensor:
    """The file's blocks of each group's 16 rows [G, 16, row_bytes] (lane None), or of one row per
    group [G, row_bytes] (lane [G]: the row's place in its group)."""
    base = FORMATS[fmt.base]
    g = groups.shape[0]
    nb, head = groups.shape[1] // (ROWS * base.nbytes), _head_bytes(base)
    b = groups.reshape(g, nb, ROWS * base.nbytes)
    fields = b[..., : ROWS * head].reshape(g, nb, head // 2, ROWS, 2).permute(0, 3, 1, 2, 4)
    at = ROWS * head
    if _high_bits(base):  # mask (t, h) bit 2c + i -> [c, t, h, i]
        masks = _bits_le(b[..., at : at + 64]).reshape(g, nb, 8, 2, ROWS, 2)
        masks, at = masks.permute(0, 4, 1, 2, 3, 5), at + 64
    if base.name in ("Q8_0", "I8"):  # [u, c, i] -> [c, u, i]
        quants = b[..., at:].reshape(g, nb, 16, ROWS, 2).permute(0, 3, 1, 2, 4)
    else:  # byte (t, c, i) -> row c's bytes
        quants = b[..., at:].reshape(g, nb, 8, ROWS, 2).permute(0, 3, 1, 2, 4)
    if lane is not None:
        picked = torch.arange(g, device=groups.device)
        fields, quants = fields[picked, lane], quants[picked, lane]
        if _high_bits(base):
            masks = masks[picked, lane]
    lead = fields.shape[:-2]
    parts = [fields.reshape(*lead, head)]
    if _high_bits(base):  # [t, h, i] is the order of k: the file's 32 bits
        parts.append(_pack_le(masks.reshape(*lead, 32)))
    if base.name not in ("Q8_0", "I8"):  # quants 4t + 2h + i -> the file's nibbles: k, k + 16
        q = torch.stack([quants & 0xF, quants >> 4], dim=-2).flatten(-3)
        quants = q[..., :16] | (q[..., 16:] << 4)
    parts.append(quants.reshape(*lead, -1))
    return torch.cat(parts, dim=-1).reshape(*lead[:-1], nb * base.nbytes)


def deinterleave(groups: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[N / 16, 16 row_bytes] of an interleaved format -> the base format's rows [N, row_bytes]."""
    return _rows(groups, fmt, None).reshape(groups.shape[0] * ROWS, -1)


def rows_of(groups: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """The base format's blocks of rows `ids` (any shape) of an interleaved weight:
    [*ids.shape, row_bytes]."""
    flat = ids.reshape(-1)
    out = _rows(groups[flat // ROWS], fmt, flat % ROWS)
    return out.reshape(*ids.shape, -1)
