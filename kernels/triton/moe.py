"""The fused mixture-of-experts MLP on CUDA: two grouped GEMMs over tokens sorted by expert.

1. Routing on the device, no host sync (so that a decode step stays one CUDA graph): each (token,
   slot) pair is placed in its expert's segment of a sorted list whose segments are padded to
   BLOCK_M rows, so that every block of BLOCK_M rows belongs to one expert (`_align`); its length
   is bounded by T*k + E*(BLOCK_M - 1), allocated as such.
2. `moe_gate_up_kernel`: per block and BLOCK_N columns of the intermediate dim, the gate and up
   products of the block's token rows with its expert's w13 rows, silu(gate) * up into a scratch
   [padded rows, I].
3. `moe_down_kernel`: per block and BLOCK_N output columns, the scratch rows times the expert's w2,
   each row stored at its (token, slot) place of a [T*k, H] buffer (every place written once).
4. The k slots of each token weighted and added in slot order (torch): no atomics anywhere, and
   every row's products run over K in one order with one tile shape whatever the number of rows,
   so a token's output never depends on which tokens share its experts (deterministic mode
   holds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.portable.moe import combine
from kernels.triton.attention import MIN_DOT, dot_fp32


@triton.jit
def _block_rows(rows, num_rows, block, BLOCK_M: tl.constexpr):
    """A block's places in the sorted list, the (token, slot) index at each (-1: padding), and
    which are real."""
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    flat = tl.load(rows + offs_m, mask=offs_m < num_rows, other=-1)
    return offs_m, flat, flat >= 0


@triton.jit(do_not_specialize=["num_rows"])
def moe_gate_up_kernel(
    x,
    w13,
    rows,
    block_expert,
    scratch,
    num_rows,
    K,
    inter,
    top_k,
    stride_x,
    stride_we,
    stride_wn,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert >= 0:
        offs_m, flat, m_mask = _block_rows(rows, num_rows, block, BLOCK_M)
        token = tl.where(m_mask, flat // top_k, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < inter
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w = w13 + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(x + token[:, None] * stride_x + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wmask = n_mask[None, :] & k_mask[:, None]
            g = tl.load(w + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=wmask,
                        other=0.0)
            u = tl.load(w + (offs_n[None, :] + inter).to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=wmask, other=0.0)
            if DOT_FP32:
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            gate = tl.dot(a, g, gate, input_precision="ieee" if DOT_FP32 else None)
            up = tl.dot(a, u, up, input_precision="ieee" if DOT_FP32 else None)
        # rounded to the activations' dtype first, as the portable path's GEMM outputs are
        gate = gate.to(scratch.dtype.element_ty).to(tl.float32)
        up = up.to(scratch.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(scratch.dtype.element_ty).to(tl.float32) * up
        tl.store(scratch + offs_m[:, None].to(tl.int64) * stride_s + offs_n[None, :],
                 act.to(scratch.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def moe_down_kernel(
    scratch,
    w2,
    rows,
    block_expert,
    out,
    num_rows,
    inter,
    H,
    stride_s,
    stride_we,
    stride_wn,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert >= 0:
        offs_m, flat, m_mask = _block_rows(rows, num_rows, block, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w = w2 + expert.to(tl.int64) * stride_we
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < inter
            a = tl.load(scratch + offs_m[:, None].to(tl.int64) * stride_s + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee" if DOT_FP32 else None)
        dest = tl.where(m_mask, flat, 0).to(tl.int64)
        tl.store(out + dest[:, None] * stride_o + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, block_expert, counts): `rows` [T*k + E*(block_m - 1)] holds each (token, slot) pair's
    flat index at its place in its expert's block-padded segment (-1 in padding); `block_expert`
    the expert of each block of `block_m` rows (-1 past the last); `counts` tokens per expert. On
    the device, no host sync."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    # (torch.bincount reads the ids' range back to the host: a sync, which a CUDA graph capture
    # refuses)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in the sorted order
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(n, device=flat.device) - first[sorted_experts]
    capacity = n + num_experts * (block_m - 1)
    rows = torch.full((capacity,), -1, dtype=torch.int64, device=flat.device)
    rows[seg_start[sorted_experts] + rank] = order
    num_blocks = capacity // block_m + 1
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    seg_end = seg_start + padded
    expert_of = torch.searchsorted(seg_end, block_start, right=True)
    block_expert = torch.where(expert_of < num_experts, expert_of, -1).to(torch.int32)
    return rows, block_expert, counts


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.ops.fused_moe` on CUDA: (the [T, H] output, tokens per expert [E])."""
    tokens, k = topk_ids.shape
    experts, hidden, inter = w13.shape[0], x.shape[1], w2.shape[2]
    x = x.contiguous()
    block_m, block_n, block_k = (64, 64, 64) if x.is_cuda else (MIN_DOT, MIN_DOT, MIN_DOT)
    rows, block_expert, counts = _align(topk_ids, experts, block_m)
    scratch = torch.empty(rows.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens * k, hidden, dtype=x.dtype, device=x.device)
    fp32 = dot_fp32(x)
    if tokens:
        moe_gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, block_n))](
            x, w13, rows, block_expert, scratch, rows.numel(), hidden, inter, k,
            x.stride(0), w13.stride(0), w13.stride(1), scratch.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=fp32,
        )  # fmt: skip
        moe_down_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
            scratch, w2, rows, block_expert, out, rows.numel(), inter, hidden,
            scratch.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=fp32,
        )  # fmt: skip
    return combine(out, topk_weights), counts
