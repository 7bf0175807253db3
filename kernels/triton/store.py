"""Triton kernel: scatter new K/V rows into the paged caches by raw slot."""

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_cache,
    v_cache,
    k,
    v,
    slots,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token; a negative slot (padding) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    row_k = tl.load(k + t * stride_k_t + offs_h * stride_k_h + offs_d, mask=mask)
    row_v = tl.load(v + t * stride_v_t + offs_h * stride_v_h + offs_d, mask=mask)
    tl.store(k_cache + slot * stride_kc_s + offs_h * stride_kc_h + offs_d, row_k, mask=mask)
    tl.store(v_cache + slot * stride_vc_s + offs_h * stride_vc_h + offs_d, row_v, mask=mask)
