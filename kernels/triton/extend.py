"""Triton kernel for paged extend (prefill / chunked prefill) attention over a ragged batch.

The grid is sized without reading lengths on the host: request b owns the program range starting at
cu_q_lens[b] // BLOCK_M + b (enough for its ceil(q_len / BLOCK_M) query blocks), so
ceil(T / BLOCK_M) + B programs per head cover every request; surplus programs exit at once.
"""

import triton
import triton.language as tl

from kernels.triton.softmax import load_kv_block, online_softmax_step, qk_dot, scores_log2


# one compile for every batch (no recompiles while serving)
@triton.jit(do_not_specialize=["num_rows"])
def extend_kernel(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_q_lens,
    seq_lens,
    out,
    num_rows,
    scale,
    soft_cap,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_pt_b,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_B)
    firsts = tl.load(cu_q_lens + offs_b, mask=offs_b < num_rows, other=0) // BLOCK_M + offs_b
    b = tl.sum(((offs_b < num_rows) & (firsts <= pid)).to(tl.int32), 0) - 1
    q_start = tl.load(cu_q_lens + b)
    q_len = tl.load(cu_q_lens + b + 1) - q_start
    m0 = (pid - (q_start // BLOCK_M + b)) * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens + b)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    qb = tl.load(
        q + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.where(sliding_window > 0, tl.maximum(prefix + m0 - sliding_window + 1, 0), 0)
    hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
    table_row = page_table + b.to(tl.int64) * stride_pt_b
    for n0 in range(lo, hi, BLOCK_N):
        offs_n, n_mask, k, v = load_kv_block(
            k_cache,
            v_cache,
            table_row,
            n0,
            hi,
            kv_head,
            offs_d,
            d_mask,
            stride_k_s,
            stride_k_h,
            stride_v_s,
            stride_v_h,
            BLOCK_N,
        )
        s = scores_log2(qk_dot(qb, k, DOT_FP32), scale, soft_cap, SOFT_CAP)
        keep = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        keep &= (sliding_window <= 0) | (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(keep, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out + rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
        result.to(out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
