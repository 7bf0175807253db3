"""The interleaved layout of a packed weight: 16 rows' blocks regrouped so that a vector of 16 float
lanes holds 16 output columns (native/packed_linear_x16.cpp reads it). The same bits in another
order, nothing re-quantized; `deinterleave` gives the file's blocks back.

For each group of 16 rows and each block of the format (32 weights, or a K-quant's 256), in order:

    halves   each fp16 / bf16 field of the block (d; then m, or dmin): 16 x 2 bytes, row c's at 2c
    bytes    each byte of Q4_K / Q5_K's packed six-bit scales and mins, or of Q6_K's int8 scales:
             16 bytes, row c's at c
    masks    per sub-block of 32 and per high bit (bit 4 of Q5_0, Q5_1, Q5_K; bits 4 and 5 of
             Q6_K), 64 bytes: one 32-bit mask per half-chunk (t, h) at 8t + 4h, its bit 2c + i row
             c's bit of quant 4t + 2h + i
    quants   per sub-block of 32, 256 bytes (8-bit: 512):
             4-bit (the low four bits of 5- and 6-bit quants): 8 chunks t of 32 bytes; byte 2c + i
             of chunk t holds row c's quant 4t + i in its low nibble and quant 4t + 2 + i in its
             high one
             8-bit: 16 chunks u of 32 bytes; byte 2c + i of chunk u is row c's quant 2u + i

so that a chunk widened to 16-bit words holds, for each of the 16 rows, one pair of neighbouring
quants (the low nibbles one pair, the high nibbles the next; the masks set their high bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.packed import FORMATS, INTERLEAVE_ROWS, BlockFormat

ROWS = INTERLEAVE_ROWS
# a block's halves [.., H, 2], bytes [.., B] and quant values [.., n]
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> their bits [..., 8 n], little endian."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """Bits [..., 8 n] (0 / 1, uint8) -> bytes [..., n], little endian."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.reshape(*bits.shape[:-1], -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles, then high (the blocks of 32's order)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _join_nibbles(q: torch.Tensor) -> torch.Tensor:
    return q[..., :16] | (q[..., 16:] << 4)


def _empty(b: torch.Tensor) -> torch.Tensor:
    return b[..., :0]


@dataclass(frozen=True)
class _Spec:
    """How a format's block splits into interleavable parts: its fp16 / bf16 fields, its scale bytes
    and its quants as values (8-bit: the raw bytes), and back."""

    value_bits: int  # 4, 5, 6 or 8
    split: Callable[[torch.Tensor], Parts]
    join: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    halves: int = 1  # 2-byte fields
    bytes: int = 0  # 1-byte fields
    subs: int = 1  # sub-blocks of 32


def _legacy(halves: int, fifth: bool) -> _Spec:
    """Blocks of 32: `halves` 2-byte fields, (Q5) 4 bytes of fifth bits, 16 bytes of nibbles."""
    at = 2 * halves

    def split(b):
        q = _nibbles(b[..., -16:])
        if fifth:
            q = q | (_bits(b[..., at : at + 4]) << 4)
        return b[..., :at].reshape(*b.shape[:-1], halves, 2), _empty(b), q

    def join(h, _, q):
        head = [h.flatten(-2), _pack(q >> 4)] if fifth else [h.flatten(-2)]
        return torch.cat([*head, _join_nibbles(q & 0xF)], dim=-1)

    return _Spec(5 if fifth else 4, split, join, halves=halves)


def _eight_bit() -> _Spec:
    def split(b):
        return b[..., :2].reshape(*b.shape[:-1], 1, 2), _empty(b), b[..., 2:]

    def join(h, _, q):
        return torch.cat([h.flatten(-2), q], dim=-1)

    return _Spec(8, split, join)


def _k_quant(fifth: bool) -> _Spec:
    """Q4_K / Q5_K: d, dmin, 12 bytes of six-bit scales and mins, (Q5_K) 32 bytes of high bits
    (bit j of byte i: sub-block j's weight i), 128 bytes of nibbles (sub-block j: chunk j / 2's
    low nibbles for even j, high for odd)."""

    def split(b):
        lead = b.shape[:-1]
        qs = b[..., -128:].reshape(*lead, 4, 1, 32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(*lead, 8, 32)
        if fifth:
            hb = _bits(b[..., 16:48]).reshape(*lead, 32, 8).transpose(-1, -2)  # [j, i]
            q = q | (hb << 4)
        return b[..., :4].reshape(*lead, 2, 2), b[..., 4:16], q.reshape(*lead, 256)

    def join(h, by, q):
        lead = q.shape[:-1]
        q = q.reshape(*lead, 4, 2, 32)
        parts = [h.flatten(-2), by]
        if fifth:
            parts.append(_pack((q.reshape(*lead, 8, 32) >> 4).transpose(-1, -2).flatten(-2)))
        low = q & 0xF
        parts.append((low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, 128))
        return torch.cat(parts, dim=-1)

    return _Spec(5 if fifth else 4, split, join, halves=2, bytes=12, subs=8)


def _q6_k() -> _Spec:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d; per half n of
    128, group g of 32 (sub-block 4n + g) takes ql[64n + 32(g & 1) + i]'s low (g < 2) or high
    nibble and bits 2g, 2g + 1 of qh[32n + i] (values 0..63, the weight d s (q - 32))."""

    def split(b):
        lead = b.shape[:-1]
        ql = b[..., :128].reshape(*lead, 2, 2, 32)  # [n, g & 1, i]
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
        low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # [n, g, i]
        shifts = (2 * torch.arange(4, dtype=torch.uint8, device=b.device)).unsqueeze(-1)
        q = low | (((qh >> shifts) & 3) << 4)
        return b[..., 208:210].reshape(*lead, 1, 2), b[..., 192:208], q.reshape(*lead, 256)

    def join(h, by, q):
        lead = q.shape[:-1]
        q = q.reshape(*lead, 2, 4, 32)  # [n, g, i]
        low = q & 0xF
        ql = low[..., :2, :] | (low[..., 2:, :] << 4)  # [n, g & 1, i]
        shifts = (2 * torch.arange(4, dtype=torch.uint8, device=q.device)).unsqueeze(-1)
        qh = ((q >> 4) << shifts).sum(-2, dtype=torch.uint8)  # [n, i]
        return torch.cat([ql.reshape(*lead, 128), qh.reshape(*lead, 64), by, h.flatten(-2)], dim=-1)

    return _Spec(6, split, join, halves=1, bytes=16, subs=8)


_SPECS: dict[str, _Spec] = {
    "Q8_0": _eight_bit(), "I8": _eight_bit(),
    "Q4_0": _legacy(1, False), "I4": _legacy(1, False), "Q4_1": _legacy(2, False),
    "Q5_0": _legacy(1, True), "Q5_1": _legacy(2, True),
    "Q4_K": _k_quant(False), "Q5_K": _k_quant(True), "Q6_K": _q6_k(),
}


def interleaved_format(fmt: BlockFormat) -> BlockFormat | None:
    """The interleaved form of `fmt` (None where it has none)."""
    return FORMATS.get(f"{fmt.name}x16")


def interleave(blocks: torch.Tensor, fmt: BlockFormat, chunk_rows: int = 4096) -> torch.Tensor:
    """Rows [N, row_bytes] of `fmt` (N a multiple of 16) -> [N / 16, 16 row_bytes] of its
    interleaved format (`chunk_rows` rows at a time: the work copies stay small beside the
    weight)."""
    return torch.cat([_interleave(blocks[i : i + chunk_rows], fmt)
                      for i in range(0, blocks.shape[0], chunk_rows)])


def _interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    spec = _SPECS[fmt.name]
    n, row_bytes = blocks.shape
    g, nb = n // ROWS, row_bytes // fmt.nbytes
    halves, by, q = spec.split(blocks.reshape(g, ROWS, nb, fmt.nbytes).transpose(1, 2))
    subs = q.shape[-1] // 32
    parts = [halves.transpose(2, 3), by.transpose(2, 3)]  # [g, nb, field, c(, 2)]
    if spec.value_bits == 8:  # [c, u, i] -> [u, c, i]
        parts.append(q.reshape(g, nb, ROWS, 16, 2).transpose(2, 3))
        return torch.cat([p.reshape(g, nb, -1) for p in parts], dim=-1).reshape(g, -1)
    # quant k = 4t + 2h + i of sub-block s
    q = q.reshape(g, nb, ROWS, subs, 8, 2, 2).permute(0, 1, 3, 4, 5, 2, 6)  # [s, t, h, c, i]
    if spec.value_bits > 4:  # a mask plane per high bit, a sub-block's planes together
        planes = torch.stack([(q >> bit) & 1 for bit in range(4, spec.value_bits)], dim=3)
        parts.append(_pack(planes.reshape(g, nb, subs, -1, 8, 2, 32)))  # [s, plane, t, h, (c, i)]
    low = (q & 0xF).permute(0, 1, 2, 3, 5, 6, 4)  # [s, t, c, i, h]
    parts.append(low[..., 0] | (low[..., 1] << 4))
    return torch.cat([p.reshape(g, nb, -1) for p in parts], dim=-1).reshape(g, -1)


def _rows(groups: torch.Tensor, fmt: BlockFormat, lane: torch.Tensor | None) -> torch.Tensor:
    """The file's blocks of each group's 16 rows [G, 16, row_bytes] (lane None), or of one row per
    group [G, row_bytes] (lane [G]: the row's place in its group)."""
    base = FORMATS[fmt.base]
    spec = _SPECS[base.name]
    n_halves, n_bytes, subs = spec.halves, spec.bytes, spec.subs
    planes = spec.value_bits - 4 if spec.value_bits < 8 else 0
    g = groups.shape[0]
    nb = groups.shape[1] // (ROWS * base.nbytes)
    b = groups.reshape(g, nb, ROWS * base.nbytes)
    at = [0]

    def take(size: int) -> torch.Tensor:
        part = b[..., at[0] : at[0] + size]
        at[0] += size
        return part

    halves = take(ROWS * 2 * n_halves).reshape(g, nb, n_halves, ROWS, 2).permute(0, 3, 1, 2, 4)
    by = take(ROWS * n_bytes).reshape(g, nb, n_bytes, ROWS).permute(0, 3, 1, 2)
    if spec.value_bits == 8:
        quants = take(ROWS * 32).reshape(g, nb, 16, ROWS, 2).permute(0, 3, 1, 2, 4)  # [c, u, i]
        masks = None
    else:  # masks [c, nb, s, plane, t, h, i]; nibble bytes [c, nb, s, t, i]
        masks = take(subs * planes * 64)
        masks = _bits(masks).reshape(g, nb, subs, planes, 8, 2, ROWS, 2).permute(
            0, 6, 1, 2, 3, 4, 5, 7)
        quants = take(subs * 256).reshape(g, nb, subs, 8, ROWS, 2).permute(0, 4, 1, 2, 3, 5)
    if lane is not None:
        picked = torch.arange(g, device=groups.device)
        halves, by, quants = halves[picked, lane], by[picked, lane], quants[picked, lane]
        masks = None if masks is None else masks[picked, lane]
    lead = halves.shape[:-2]  # [g(, c), nb]
    if spec.value_bits == 8:
        q = quants.reshape(*lead, 32)
    else:  # value k = 4t + 2h + i of sub-block s
        q = torch.stack([quants & 0xF, quants >> 4], dim=-2).reshape(*lead, subs, 32)
        for plane in range(planes):
            q = q | (masks[..., plane, :, :, :].reshape(*lead, subs, 32) << (4 + plane))
        q = q.reshape(*lead, subs * 32)
    out = spec.join(halves, by, q)
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
