"""Triton kernels for paged decode attention, flash-decoding style.

Stage 1: one program per (row, KV head, split) attends the group of query heads sharing that KV head
(GQA packed into the M dimension of the dots) over its slice of the context, and writes a partial
output with its base-2 log-sum-exp. Stage 2: one program per (row, head) merges the splits.

Deterministic mode runs one split (no split-K, whose count follows the batch size) and, for an
extend, one program per query token (`query_rows`: each token's page-table row, `seq_lens` then per
token): a query's result is then the same blocks of keys in the same order whatever its batch or
step kind.
"""

import triton
import triton.language as tl

from kernels.triton.softmax import load_kv_block, online_softmax_step, qk_dot, scores_log2


@triton.jit
def decode_split_kernel(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    query_rows,
    part_out,
    part_lse,
    scale,
    soft_cap,
    sliding_window,
    split_len,
    stride_q_b,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_pt_b,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
):
    # the query (a row of q), whose page-table row is b, or query_rows[b] with QUERY_ROWS
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    lo = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    qh = tl.load(
        q + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if QUERY_ROWS:
        row = page_table + tl.load(query_rows + b).to(tl.int64) * stride_pt_b
    else:
        row = page_table + b.to(tl.int64) * stride_pt_b
    for n0 in range(start, end, BLOCK_N):
        _, n_mask, k, v = load_kv_block(
            k_cache,
            v_cache,
            row,
            n0,
            end,
            kv_head,
            offs_d,
            d_mask,
            stride_k_s,
            stride_k_h,
            stride_v_s,
            stride_v_h,
            BLOCK_N,
        )
        s = scores_log2(qk_dot(qh, k, DOT_FP32), scale, soft_cap, SOFT_CAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    part = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(part_out + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=h_mask[:, None])
    tl.store(part_lse + part, lse, mask=h_mask)


@triton.jit
def decode_merge_kernel(
    part_out,
    part_lse,
    out,
    stride_o_b,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Weight each split's output by its share of the softmax mass; a row with no context gets 0."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (b * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(weight, 0)
    partial = tl.load(
        part_out + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    merged = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out + b * stride_o_b + head * stride_o_h + offs_d,
        merged.to(out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
