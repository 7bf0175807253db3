"""Paged attention through the `kernels.ops` custom ops, and the per-step metadata it reads."""

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops


@dataclass
class AttentionMetadata:
    """One step's batch as the attention ops see it (B rows, T tokens).

    out_slots[T] int64: KV slot each new token writes (-1: nowhere).
    page_table[B, W] int32: raw KV slot of token i of row b.
    seq_lens[B] int32: tokens of row b after this step (0: padding row).
    cu_q_lens[B + 1] int32: row b owns tokens cu_q_lens[b]:cu_q_lens[b + 1].
    is_decode: exactly one new token per row (T == B).
    lora_slots[T] int64: each token's LoRA adapter slot (-1: none); None when no token of the step
        has an adapter (the graphs without adapters run then).
    """

    out_slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q_lens: torch.Tensor
    is_decode: bool
    lora_slots: torch.Tensor | None = None


class Attention(nn.Module):
    """Stores this step's K/V in the layer's cache, then attends. The runner attaches `k_cache` and
    `v_cache` ([num_slots, num_kv_heads, head_dim]) once it has sized the KV pool."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]."""
        ops.store_kv(self.k_cache, self.v_cache, k, v, meta.out_slots)
        if meta.is_decode:
            return ops.decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.page_table,
                meta.seq_lens,
                self.scale,
                self.sliding_window,
                invariant=self.batch_invariant,
            )
        return ops.extend_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.page_table,
            meta.cu_q_lens,
            meta.seq_lens,
            self.scale,
            self.sliding_window,
            invariant=self.batch_invariant,
        )
