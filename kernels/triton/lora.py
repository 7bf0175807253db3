"""LoRA's batched delta on CUDA, punica's BGMV: each token reads its own adapter's A and B by its
slot, so the gathered [T, R, K] and [T, N, R] copies of the portable path are never written.

1. `lora_shrink_kernel`, per (token, K split, R tile): the token's partial h = A[slot] @ x over its
   split's part of K, in fp32, into `partial` [T, splits, R].
2. `lora_expand_kernel`, per (token, N tile), once per projection of B (q / k / v, gate / up: B is
   block-diagonal by projection, `part_rows`): h as the sum of the token's partial sums in split
   order, then y = B[slot] @ h over the projection's columns only, in fp32, stored in x's dtype.

A program reads one token's row only, and every tile size and the number of splits follow from K,
R and N alone (never T), each sum in one order: a token's result is the same bits whatever the
batch (deterministic mode holds). No host sync: the grids come from the shapes, and slot -1 (the
last slot) is resolved on the device, so a step stays one CUDA graph."""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16  # of K, so that a few tokens still fill the GPU's SMs


@triton.jit
def _slot(slots, token, num_slots):
    """The token's adapter slot, -1 read as the last one."""
    slot = tl.load(slots + token).to(tl.int64)
    return tl.where(slot < 0, slot + num_slots, slot)


@triton.jit
def lora_shrink_kernel(
    x, a, slots, partial, num_slots, K, R, split_k, stride_x, stride_as, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    rows = a + _slot(slots, token, num_slots) * stride_as + offs_r[:, None].to(tl.int64) * stride_ar
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, split_k, BLOCK_K):  # split_k: a multiple of BLOCK_K
        offs_k = split * split_k + k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xk = tl.load(x + token * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += ak.to(tl.float32) * xk[None, :]
    h = tl.sum(acc, axis=1)
    tl.store(partial + (token * tl.num_programs(1) + split) * R + offs_r, h, mask=r_mask)


@triton.jit
def lora_expand_kernel(
    partial, b, slots, out, num_slots, N, R, num_splits, stride_pt, stride_ps, stride_bs, stride_bn,
    stride_br, stride_o, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_mask, s_mask = offs_n < N, offs_s < num_splits
    rows = b + _slot(slots, token, num_slots) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
    token_partial = partial + token * stride_pt + offs_s[:, None] * stride_ps
    acc = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        h = tl.sum(tl.load(token_partial + offs_r[None, :], mask=s_mask[:, None] & r_mask[None, :],
                           other=0.0), axis=0)
        br = tl.load(rows + offs_r[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :],
                     other=0.0)
        acc += br.to(tl.float32) * h[None, :]
    tl.store(out + token * stride_o + offs_n, tl.sum(acc, axis=1).to(out.dtype.element_ty),
             mask=n_mask)


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                      part_rows: Sequence[int]) -> torch.Tensor:
    """`kernels.ops.lora_delta` on CUDA: x [T, K], a [S, R, K], b [S, N, R], slots [T] -> [T, N]
    in x's dtype. `part_rows`: the P + 1 row boundaries of B's projections, projection p's rows
    reading the p-th R / P columns only (() or (0, N): one projection)."""
    x, slots = (x if x.stride(-1) == 1 else x.contiguous()), slots.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    (tokens, k), (num_slots, r, _), n = x.shape, a.shape, b.shape[1]
    bounds = list(part_rows) or [0, n]
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if not (tokens and n):
        return out
    if x.is_cuda:  # tiles of at most 2048 fp32 products: under 100 registers a thread at sm_90
        block_k, block_n, max_splits = 64, 64, MAX_SPLITS
        block_r = min(32, triton.next_power_of_2(r))
    else:  # the interpreter: small tiles, so that the tests cross every edge at small shapes
        block_k, block_r, block_n, max_splits = 16, 16, 16, 2
    split_k = block_k * triton.cdiv(triton.cdiv(k, block_k), max_splits)
    splits = triton.cdiv(k, split_k)
    partial = torch.empty(tokens, splits, r, dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(tokens, splits, triton.cdiv(r, block_r))](
        x, a, slots, partial, num_slots, k, r, split_k, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    width = r // (len(bounds) - 1)  # of each projection's columns
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        cols = slice(p * width, (p + 1) * width)
        lora_expand_kernel[(tokens, triton.cdiv(hi - lo, block_n))](
            partial[:, :, cols], b[:, lo:hi, cols], slots, out[:, lo:hi], num_slots, hi - lo, width,
            splits, partial.stride(0), partial.stride(1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0),
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_N=block_n,
            BLOCK_R=min(block_r, triton.next_power_of_2(width)),
        )  # fmt: skip
    return out
