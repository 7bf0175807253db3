"""Vocab-parallel embedding and LM head. Each rank holds `ceil(vocab / tp)` rows; the last rank's
rows past the vocabulary are zero padding, never refused and never visible in the logits."""

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.layers.weight_utils import WeightSource, check_shape, narrow
from compiled_engine.parallel import parallel_state as ps
from kernels import ops


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size = ps.get_tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = ps.get_tp_rank() * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        check_shape(src, (self.vocab_size, param.shape[1]))
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(narrow(src, 0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight) * mine.unsqueeze(-1).to(
            self.weight.dtype
        )
        return ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary; `tie_to` shares the embedding's weight."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(vocab_size, hidden_size)
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        if tie_to is not None:
            self.weight = tie_to.weight

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
