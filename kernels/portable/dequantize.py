"""Packed blocks -> fp32 weights in torch (kernels/packed.py has the formats): the portable
`kernels::dequantize` and what the portable packed linear multiplies by. Each format's arithmetic is
llama.cpp's (ggml-quants.c `dequantize_row_*`), so the values equal the `gguf` package's."""

from __future__ import annotations

import torch

from kernels.interleave import deinterleave
from kernels.packed import BY_CODE, FORMATS, BlockFormat


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block [..., nbytes] as fp32 [..., 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at : at + 2].contiguous().view(torch.bfloat16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes [..., 16] -> 32 values: low nibbles (weights 0-15), then high (16-31)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).float()


def _bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """Bits 0..n-1 of little-endian bytes [..., n/8] as [..., n] (0 or 1)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], n).float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (`get_scale_min_k4`)."""
    s = s.to(torch.int32)
    lo, hi = s[..., 0:4], s[..., 4:8]
    top = s[..., 8:12]
    scales = torch.cat([lo & 63, (top & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([hi & 63, (top >> 4) | ((hi >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _q8_0(b):
    return _f16(b, 0) * b[..., 2:34].view(torch.int8).float()


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[..., 2:18]) - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[..., 4:20]) + _f16(b, 2)


def _q5_0(b):
    return _f16(b, 0) * (_nibbles(b[..., 6:22]) + 16 * _bits(b[..., 2:6], 32) - 16)


def _q5_1(b):
    return _f16(b, 0) * (_nibbles(b[..., 8:24]) + 16 * _bits(b[..., 4:8], 32)) + _f16(b, 2)


def _k_quant(b, qs_at: int, qh_at: int | None):
    """Q4_K (qh_at None) and Q5_K: sub-block j of 32 takes chunk j/2's low (even j) or high nibbles,
    and (Q5_K) bit j of each of the 32 high-bit bytes."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales(b[..., 4:16])
    qs = b[..., qs_at : qs_at + 128].reshape(*b.shape[:-1], 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()
    if qh_at is not None:
        qh = b[..., qh_at : qh_at + 32].unsqueeze(-2)
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).unsqueeze(-1)
        q = q + 16 * ((qh >> shifts) & 1).float()
    w = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return w.reshape(*b.shape[:-1], 256)


def _q4_k(b):
    return _k_quant(b, 16, None)


def _q5_k(b):
    return _k_quant(b, 48, 16)


def _q6_k(b):
    """Per 128-half n: groups g = 0..3 of 32 take ql[64n + 32(g&1) + l]'s low (g < 2) or high
    nibble and bits 2g, 2g+1 of qh[32n + l]; scales 16 x int8, one per 16 weights."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [n, g&1, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # [n, g, l]
    shifts = (2 * torch.arange(4, dtype=torch.uint8, device=b.device)).unsqueeze(-1)
    q = (low | (((qh >> shifts) & 3) << 4)).float() - 32
    scales = b[..., 192:208].view(torch.int8).float().reshape(*b.shape[:-1], 2, 4, 2, 1)
    d = _f16(b, 208).reshape(*b.shape[:-1], 1, 1, 1, 1)
    w = d * scales * q.reshape(*b.shape[:-1], 2, 4, 2, 16)
    return w.reshape(*b.shape[:-1], 256)


def _i8(b):
    return _bf16(b, 0) * b[..., 2:34].view(torch.int8).float()


def _i4(b):
    return _bf16(b, 0) * (_nibbles(b[..., 2:18]) - 8)


_DEQUANTIZE = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "I8": _i8, "I4": _i4,
}


def dequantize_blocks(blocks: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    rows = blocks.reshape(-1, in_features // fmt.block, fmt.nbytes)
    values = _DEQUANTIZE[fmt.name](rows)
    return values.reshape(*blocks.shape[:-1], in_features)


def dequantize(blocks: torch.Tensor, code: int, in_features: int) -> torch.Tensor:
    """`kernels::dequantize`: blocks [..., row_bytes] uint8 -> fp32 [..., in_features]; an
    interleaved format's groups [G, 16 row_bytes] -> [16 G, in_features] in row order."""
    fmt = BY_CODE[code]
    if fmt.rows > 1:
        return dequantize_blocks(deinterleave(blocks, fmt), FORMATS[fmt.base], in_features)
    return dequantize_blocks(blocks, fmt, in_features)


def linear_packed(x, blocks, code, in_features, bias=None, invariant=False):
    """`kernels::linear_packed` without a native kernel: the weight dequantized to fp32 and
    multiplied in fp32 (exact up to fp32 rounding), one row at a time when `invariant`."""
    w = dequantize(blocks, code, in_features)
    rows = x.reshape(-1, in_features).float()
    b = None if bias is None else bias.float()
    if invariant and rows.shape[0] > 1:
        out = torch.cat([torch.nn.functional.linear(rows[i : i + 1], w, b)
                         for i in range(rows.shape[0])])
    else:
        out = torch.nn.functional.linear(rows, w, b)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
