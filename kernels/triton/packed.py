"""The packed linear on CUDA: out = x @ W.T (+ bias) with W in its file's blocks of 32 (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, I8, I4: kernels/packed.py), dequantized tile by tile in registers (llama.cpp's
arithmetic, as the portable dequantize) and multiplied in fp32: the weight is read as
packed bytes, never written out as a dense copy. One tile shape for every M and K in order, as the
invariant matmul (matmul.py): each row's result is the same whatever the batch. The K-quants take
the portable path (dequantize, then fp32 linear) for now."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.packed import BlockFormat
from kernels.triton.attention import MIN_DOT


@dataclass(frozen=True)
class _Layout:
    bits: int  # 4, 5 or 8
    qs_at: int  # byte of the quants (nibbles, or int8)
    qh_at: int = -1  # byte of the 32 fifth bits
    m_at: int = -1  # byte of the fp16 min (w = d q + m)
    offset: int = 0  # w = d (q + offset) without a min
    bf16: bool = False  # the scale (and min) in bf16, not fp16


LAYOUTS = {
    "Q8_0": _Layout(8, 2), "I8": _Layout(8, 2, bf16=True),
    "Q4_0": _Layout(4, 2, offset=-8), "I4": _Layout(4, 2, offset=-8, bf16=True),
    "Q4_1": _Layout(4, 4, m_at=2),
    "Q5_0": _Layout(5, 6, qh_at=2, offset=-16), "Q5_1": _Layout(5, 8, qh_at=4, m_at=2),
}


@triton.jit
def _scalar16(ptr, BF16: tl.constexpr):
    """The fp16 (bf16) field at ptr [BLOCK_N] as fp32."""
    bits = tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8)
    if BF16:
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def packed_matmul_kernel(
    x, blocks, bias, out, M, N, K, stride_xm, row_bytes, stride_om,
    NBYTES: tl.constexpr, BITS: tl.constexpr, QS_AT: tl.constexpr, QH_AT: tl.constexpr,
    M_AT: tl.constexpr, OFFSET: tl.constexpr, BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    kk = tl.arange(0, 32)
    rows = blocks + offs_n.to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, K // 32):
        a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + kb * 32 + kk[None, :],
                    mask=m_mask[:, None], other=0.0).to(tl.float32)
        p = tl.where(n_mask, rows + kb * NBYTES, blocks)  # masked rows read block 0
        d = _scalar16(p, BF16)
        if BITS == 8:
            q = tl.load(p[:, None] + QS_AT + kk[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        else:  # weight k: the low nibble of byte k % 16 for k < 16, the high one after
            byte = tl.load(p[:, None] + QS_AT + (kk % 16)[None, :]).to(tl.int32)
            qi = (byte >> ((kk // 16) * 4)[None, :]) & 0xF
            if BITS == 5:
                hb = tl.load(p[:, None] + QH_AT + (kk // 8)[None, :]).to(tl.int32)
                qi = qi | (((hb >> (kk % 8)[None, :]) & 1) << 4)
            q = qi.to(tl.float32)
        if M_AT >= 0:
            w = d[:, None] * q + _scalar16(p + M_AT, BF16)[:, None]
        elif OFFSET != 0:
            w = d[:, None] * (q + OFFSET)
        else:
            w = d[:, None] * q
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def supports(fmt: BlockFormat) -> bool:
    return fmt.name in LAYOUTS


def packed_linear_triton(
    x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for a weight of `fmt`'s blocks [N, row_bytes] (a format of
    LAYOUTS, in the file's layout); out in x's dtype."""
    layout = LAYOUTS[fmt.name]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = blocks.contiguous()
    m, n = rows.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m, block_n = (64, 64) if x.is_cuda else (MIN_DOT, MIN_DOT)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        packed_matmul_kernel[grid](
            rows, w, bias if bias is not None else rows, out, m, n, in_features,
            rows.stride(0), w.stride(0), out.stride(0),
            NBYTES=fmt.nbytes, BITS=layout.bits, QS_AT=layout.qs_at, QH_AT=layout.qh_at,
            M_AT=layout.m_at, OFFSET=layout.offset, BF16=layout.bf16,
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
