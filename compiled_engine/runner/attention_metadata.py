"""What the attention ops read each step (after mini-sglang's `attention/base.py`, with the one
paged backend as plain functions): the step's `AttentionMetadata` from the plan's tensors, and the
metadata tensors whose first dimension changes between steps (the dynamic graphs mark them). The ops
(`kernels.ops`) pick Triton on CUDA and the native or portable kernels on the CPU."""

from __future__ import annotations

import torch

from compiled_engine.layers.attention import AttentionMetadata


def build_metadata(page_rows: torch.Tensor, out_slots: torch.Tensor, seq_lens: torch.Tensor,
                   cu_q_lens: torch.Tensor, is_decode: bool,
                   lora_slots: torch.Tensor | None = None) -> AttentionMetadata:
    """The step's metadata; `page_rows` [B, W]: each row's raw KV slots (the device page table's
    rows); `lora_slots`: each token's adapter slot (None: no adapter in the step)."""
    return AttentionMetadata(
        out_slots=out_slots,
        page_table=page_rows,
        seq_lens=seq_lens,
        cu_q_lens=cu_q_lens,
        is_decode=is_decode,
        lora_slots=lora_slots,
    )


def dynamic_tensors(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The metadata tensors whose dimension 0 is the step's token or request count."""
    lora = () if meta.lora_slots is None else (meta.lora_slots,)
    return meta.out_slots, meta.page_table, meta.seq_lens, meta.cu_q_lens, *lora

