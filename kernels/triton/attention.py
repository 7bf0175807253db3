"""Launchers of the Triton kernels. They run on CUDA tensors, and on CPU tensors under
TRITON_INTERPRET=1.

No launcher reads a tensor on the host: grids and loop bounds come from shapes (the page-table width
W bounds every context), so a CUDA-graph-captured step replays them as they are.
"""

import functools

import torch
import triton

from kernels.triton.decode import decode_merge_kernel, decode_split_kernel
from kernels.triton.extend import extend_kernel
from kernels.triton.store import store_kv_kernel

MIN_DOT = 16  # tl.dot needs every dimension >= 16 on the GPU
MIN_SPLIT_TOKENS = 256  # a decode split should read at least this much context


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_d(head_dim: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def dot_fp32(q: torch.Tensor) -> bool:
    """fp32 products for fp32 inputs, and always in the interpreter (its bf16 arithmetic is
    wrong)."""
    return not q.is_cuda or q.dtype == torch.float32


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    tokens, num_kv, head_dim = k.shape
    if tokens == 0:
        return
    assert k_cache.stride(2) == v_cache.stride(2) == k.stride(2) == v.stride(2) == 1
    store_kv_kernel[(tokens,)](
        k_cache, v_cache, k, v, slots,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _decode_splits(q: torch.Tensor, num_kv: int, context_bound: int, block_n: int) -> int:
    """Enough splits to fill the GPU about twice, each reading >= MIN_SPLIT_TOKENS of context."""
    if not q.is_cuda:
        return 1
    programs = q.shape[0] * num_kv
    wanted = triton.cdiv(2 * _num_sms(q.device.index or 0), programs)
    most = triton.cdiv(context_bound, max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(wanted, most))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    num_splits: int | None = None,
    query_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention, [B, H, D] -> [B, H, D]. Slots are loaded per token, so any page size
    works.

    `num_splits` overrides the split-K heuristic (tests use it on the CPU; deterministic mode runs
    1). `query_rows` [B] int32: each query's page-table row (default: query b reads row b).
    """
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty_like(q)
    if batch == 0:
        return out
    assert q.stride(2) == k_cache.stride(2) == v_cache.stride(2) == page_table.stride(1) == 1
    block_d = _block_d(head_dim)
    block_n = 32 if head_dim > 128 else 64
    bound = page_table.shape[1] if sliding_window <= 0 else min(page_table.shape[1], sliding_window)
    splits = num_splits or _decode_splits(q, num_kv, bound, block_n)
    split_len = triton.cdiv(triton.cdiv(bound, splits), block_n) * block_n
    part_out = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    decode_split_kernel[(batch, num_kv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, seq_lens if query_rows is None else query_rows,
        part_out, part_lse,
        scale, soft_cap, sliding_window, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        GROUP=group, NUM_HEADS=num_heads, NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        SOFT_CAP=soft_cap > 0, DOT_FP32=dot_fp32(q), QUERY_ROWS=query_rows is not None,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def extend_block_b(batch: int) -> int:
    """The extend kernel's request block: a power of two, at least 16, so that serving meets few
    variants (the warm-up compiles each one a batch can reach: `extend_block_sizes`)."""
    return max(16, triton.next_power_of_2(batch))


def extend_block_sizes(max_requests: int) -> list[int]:
    """Every request block a step of up to `max_requests` requests (padding included) runs with."""
    return sorted({extend_block_b(n) for n in range(1, max_requests + 1)})


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Paged causal attention of a ragged batch of new tokens, [T, H, D] -> [T, H, D]; rows of q
    past cu_q_lens[-1] (token padding) give zeros."""
    tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    out = torch.zeros_like(q)
    if tokens == 0 or batch == 0:
        return out
    assert q.stride(2) == k_cache.stride(2) == v_cache.stride(2) == page_table.stride(1) == 1
    block_d = _block_d(head_dim)
    if q.is_cuda:
        block_m, block_n, warps = (64, 32, 8) if head_dim > 128 else (64, 64, 4)
    else:
        block_m, block_n, warps = MIN_DOT, MIN_DOT, 4
    grid = (triton.cdiv(tokens, block_m) + batch, num_heads)
    extend_kernel[grid](
        q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, out, batch,
        scale, soft_cap, sliding_window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_B=extend_block_b(batch),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        SOFT_CAP=soft_cap > 0, DOT_FP32=dot_fp32(q), num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out


def extend_attention_invariant_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Deterministic mode's extend: every query token as a one-split decode of the keys up to its
    position (bit-identical to a decode step of that query); token padding past cu_q_lens[-1] gives
    zeros."""
    tokens = q.shape[0]
    t = torch.arange(tokens, device=q.device, dtype=torch.int32)
    req = torch.searchsorted(cu_q_lens[1:].to(torch.int32), t, right=True).clamp(
        max=seq_lens.shape[0] - 1
    )
    ends = cu_q_lens[1:].to(torch.int32)[req]
    lens = torch.where(t < cu_q_lens[-1], seq_lens.to(torch.int32)[req] - (ends - t) + 1, 0).to(
        torch.int32
    )
    return decode_attention_triton(
        q,
        k_cache,
        v_cache,
        page_table,
        lens,
        scale,
        sliding_window,
        soft_cap,
        num_splits=1,
        query_rows=req.to(torch.int32),
    )

