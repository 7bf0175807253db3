"""Vocab-parallel embedding and LM head. Each rank holds `ceil(vocab / tp)` rows; the last rank's
rows past the vocabulary are zero padding, never refused and never visible in the logits. A packed
checkpoint tensor (`PackedSource`) stays packed, its padding rows zero blocks (which are zeros in
every format); its rows are dequantized as they are looked up."""

import torch
from torch import nn

from compiled_engine.layers.weight_utils import PackedSource, WeightSource, check_shape, narrow
from compiled_engine.parallel import parallel_state as ps
from kernels import ops
from kernels.packed import PackedWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size = ps.get_tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = ps.get_tp_rank() * self.rows_per_rank
        self.compute_dtype = torch.get_default_dtype()
        self.weight: nn.Parameter | PackedWeight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        check_shape(src, (self.vocab_size, param.shape[1]))
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        part = narrow(src, 0, self.vocab_start, rows)
        if isinstance(part, PackedSource):
            padding = part.blocks.new_zeros(self.rows_per_rank - rows, part.blocks.shape[1])
            del self.weight
            self.weight = PackedWeight(torch.cat([part.blocks, padding]), part.format,
                                       part.shape[1])
            return
        param.data[:rows].copy_(part)
        param.data[rows:].zero_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight).to(self.compute_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = self.lookup(local.masked_fill(~mine, 0)) * mine.unsqueeze(-1).to(self.compute_dtype)
        return ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary; `tie_to` shares the embedding's weight (packed or
    not: `finish_loading` ties it again once the embedding's weight is in)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(vocab_size, hidden_size)
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        self._tied = (tie_to,) if tie_to is not None else ()  # a tuple: not a submodule
        if tie_to is not None:
            self.weight = tie_to.weight

    def finish_loading(self) -> None:
        if self._tied and self.weight is not self._tied[0].weight:
            del self.weight
            self.weight = self._tied[0].weight

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the vocabulary: [N, rows_per_rank]."""
        return ops.linear(hidden, self.weight, invariant=self.batch_invariant)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's slice, in rank order, without the padding rows: [N, vocab_size]."""
        if self.tp_size == 1:
            return local
        return ps.all_gather(local, dim=-1)[:, : self.vocab_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather_logits(self.local_logits(hidden))
