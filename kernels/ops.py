"""The attention and KV-store custom ops (`torch.ops.kernels.*`): Triton on CUDA, torch on the CPU.

Each op is opaque to torch.compile (one node, a `register_fake` for shapes). The Triton module is imported
on first CUDA use only, so that tests can set TRITON_INTERPRET before anything decorates a kernel.
"""

import torch

from kernels import cpu_attention


@torch.library.custom_op("kernels::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into the caches [S, Hkv, D] at `slots` [T] int64; slots < 0 are skipped."""
    if k_cache.is_cuda:
        from kernels import triton_attention

        triton_attention.store_kv_triton(k_cache, v_cache, k, v, slots)
    else:
        cpu_attention.store_kv_cpu(k_cache, v_cache, k, v, slots)


@store_kv.register_fake
def _(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    return None


@torch.library.custom_op("kernels::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """One new query per row: q [B, H, D] -> [B, H, D]; rows with seq_len 0 give zeros."""
    if q.is_cuda:
        from kernels import triton_attention

        return triton_attention.decode_attention_triton(
            q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window, soft_cap
        )
    return cpu_attention.decode_attention_cpu(
        q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window, soft_cap
    )


@decode_attention.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("kernels::extend_attention", mutates_args=())
def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Ragged new tokens q [T, H, D] -> [T, H, D]: request b's queries cu_q_lens[b]:cu_q_lens[b+1] are its
    last positions and attend causally to the whole row (prefix included)."""
    if q.is_cuda:
        from kernels import triton_attention

        return triton_attention.extend_attention_triton(
            q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size, sliding_window, soft_cap
        )
    return cpu_attention.extend_attention_cpu(
        q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap
    )


@extend_attention.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    return torch.empty_like(q)
