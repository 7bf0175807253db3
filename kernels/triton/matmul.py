"""A batch-invariant matmul for deterministic mode on CUDA: out = x @ w.T (+ bias) with one tile
shape for every M and no split of K, so every output row is the same sequence of tile products over
K in order, whatever the number of rows (cuBLAS picks its kernel, and its split of K, by the
shape)."""

import torch
import triton
import triton.language as tl

from kernels.triton.attention import MIN_DOT, dot_fp32


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def invariant_matmul_kernel(
    x,
    w,
    bias,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee" if DOT_FP32 else None)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def invariant_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) with every row independent of the others (deterministic mode's
    linear)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = rows.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m, block_n, block_k = (64, 64, 64) if x.is_cuda else (MIN_DOT, MIN_DOT, MIN_DOT)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        invariant_matmul_kernel[grid](
            rows, w, bias if bias is not None else w, out, m, n, k,
            rows.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_FP32=dot_fp32(x),
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
