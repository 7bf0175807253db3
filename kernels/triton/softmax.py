"""Shared Triton helpers for the attention kernels: a block of paged K/V, the score transform and
one online-softmax step."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh from exp2 (libdevice tanh is unavailable in the interpreter)."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def load_kv_block(
    k_cache,
    v_cache,
    table_row,
    n0,
    end,
    kv_head,
    offs_d,
    d_mask,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    BLOCK_N: tl.constexpr,
):
    """K and V [BLOCK_N, D] of positions n0 .. n0 + BLOCK_N of one KV head, through the row's raw
    slots; positions >= end read zeros. Returns (positions, their mask, k, v)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    slot = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache + slot[:, None] * stride_k_s + kv_head * stride_k_h + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache + slot[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    return offs_n, n_mask, k, v


@triton.jit
def scores_log2(qk, scale, soft_cap, SOFT_CAP: tl.constexpr):
    """q.k -> logits in base 2 (optionally soft-capped: cap * tanh(logit / cap))."""
    s = qk * scale
    if SOFT_CAP:
        s = soft_cap * tanh(s / soft_cap)
    return s * LOG2E


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """Fold masked base-2 logits s [M, N] (-inf = masked) and values v [N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        v = v.to(tl.float32)
    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee" if DOT_FP32 else None)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def qk_dot(q, k, DOT_FP32: tl.constexpr):
    """q [M, D] . k [N, D]^T in fp32; fp32 inputs (and the interpreter) use exact fp32 products."""
    if DOT_FP32:
        q, k = q.to(tl.float32), k.to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision="ieee" if DOT_FP32 else None)
