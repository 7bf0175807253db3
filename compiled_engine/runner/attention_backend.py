"""The attention backend: the one place that knows what the attention ops read each step (after
mini-sglang's `attention/base.py`). It builds the step's `AttentionMetadata` from the plan's tensors, names
the metadata tensors whose first dimension changes between steps (the dynamic graphs mark them), and
refreshes a captured CUDA graph's static metadata before a replay. The paged backend is the only one: its
ops (`kernels.ops`) pick Triton on CUDA and the native or portable kernels on the CPU."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from compiled_engine.layers.attention import AttentionMetadata


class AttentionBackend(ABC):
    @abstractmethod
    def metadata(self, page_rows: torch.Tensor, out_slots: torch.Tensor, seq_lens: torch.Tensor,
                 cu_q_lens: torch.Tensor, is_decode: bool) -> AttentionMetadata:
        """The step's metadata; `page_rows` [B, W]: each row's raw KV slots (the device page table's rows)."""

    @abstractmethod
    def dynamic_tensors(self, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The metadata tensors whose dimension 0 is the step's token or request count."""

    @abstractmethod
    def copy_for_replay(self, static: AttentionMetadata, step: AttentionMetadata) -> None:
        """Write `step`'s metadata into the buffers a captured graph reads (`static`)."""


class PagedAttentionBackend(AttentionBackend):
    def metadata(self, page_rows: torch.Tensor, out_slots: torch.Tensor, seq_lens: torch.Tensor,
                 cu_q_lens: torch.Tensor, is_decode: bool) -> AttentionMetadata:
        return AttentionMetadata(out_slots=out_slots, page_table=page_rows, seq_lens=seq_lens, cu_q_lens=cu_q_lens,
                                 is_decode=is_decode)

    def dynamic_tensors(self, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        return meta.out_slots, meta.page_table, meta.seq_lens, meta.cu_q_lens

    def copy_for_replay(self, static: AttentionMetadata, step: AttentionMetadata) -> None:
        for dst, src in zip(self.dynamic_tensors(static), self.dynamic_tensors(step), strict=True):
            dst.copy_(src)


PAGED = PagedAttentionBackend()
