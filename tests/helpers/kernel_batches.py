"""Random paged batches for the attention tests: pages scattered through the cache in random
order."""

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q_lens: torch.Tensor
    q: torch.Tensor
    page_size: int

    def decode_args(self, scale: float) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.seq_lens, scale)

    def extend_args(self, scale: float) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.page_table,
            self.cu_q_lens,
            self.seq_lens,
            scale,
        )


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_width: int = 0,
) -> PagedBatch:
    """Rows with `seq_lens` tokens, the last `q_lens` of which are queries (q has sum(q_lens) rows).

    A row with seq_len 0 is padding: its page-table row is -1. Slot 0's page is never handed out, so
    the cache also holds data no row owns. Entries past a row's length are -1.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    width = max(max(pages_per_row, default=0) * page_size, 1) + extra_width
    page_table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        pages = [order.pop() for _ in range(pages_per_row[b])]
        slots = [p * page_size + i for p in pages for i in range(page_size)][:n]
        page_table[b, :n] = torch.tensor(slots, dtype=torch.int32)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor(
        [0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    return PagedBatch(
        k_cache, v_cache, page_table, torch.tensor(seq_lens, dtype=torch.int32), cu, q, page_size
    )
