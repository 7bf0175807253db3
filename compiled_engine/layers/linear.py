"""Column- and row-parallel linear layers with their checkpoint loaders.

Column parallel splits the output features over the TP ranks (no communication); row parallel splits
the input features and sums the partial products with one all-reduce.
"""

import torch
from torch import nn

from compiled_engine.layers.weight_utils import WeightSource, check_shape, narrow
from compiled_engine.parallel import parallel_state as ps
from kernels import ops


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.get_tp_rank(), ps.get_tp_size()
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, ps.get_tp_size(), "out_features"), bias)
        self.full_out = out_features

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        check_shape(src, (self.full_out, *param.shape[1:]))
        rows = param.shape[0]
        param.data.copy_(narrow(src, 0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.batch_invariant)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up); `shard_id` indexes
    `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes = sizes

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        full = self.sizes[shard_id]
        check_shape(src, (full, *param.shape[1:]))
        rows = full // self.tp_size
        offset = sum(self.sizes[:shard_id]) // self.tp_size
        param.data[offset : offset + rows].copy_(narrow(src, 0, self.tp_rank * rows, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads are split over the ranks; KV heads too, or
    replicated (each rank holding one) when there are fewer KV heads than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = ps.get_tp_size()
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        elif tp % num_kv_heads == 0:
            self.num_kv_heads = 1
        else:
            raise ValueError(
                f"tensor-parallel size {tp} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        self.head_dim = head_dim
        self.full_sizes = {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias)
        self.kv_replicas = max(1, tp // num_kv_heads)

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        check_shape(src, (self.full_sizes[shard_id], *param.shape[1:]))
        if shard_id == "q":
            offset, rows, head0 = 0, self.q_size, self.tp_rank * self.num_heads
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, head0 = self.kv_size, (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        param.data[offset : offset + rows].copy_(narrow(src, 0, head0 * self.head_dim, rows))


class RowParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, ps.get_tp_size(), "in_features"), out_features, bias)
        self.full_in = in_features

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            check_shape(src, tuple(param.shape))
            param.data.copy_(src[:])
            return
        check_shape(src, (param.shape[0], self.full_in))
        cols = param.shape[1]
        param.data.copy_(narrow(src, 1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ps.all_reduce(
            ops.linear(x, self.weight, invariant=self.batch_invariant), ordered=self.batch_invariant
        )
        return y if self.bias is None else y + self.bias
