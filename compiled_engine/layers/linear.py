"""Column- and row-parallel linear layers with their checkpoint loaders.

Column parallel splits the output features over the TP ranks (no communication); row parallel splits
the input features and sums the partial products with one all-reduce.

A weight that comes packed (`PackedSource`: a GGUF tensor in its block format) stays packed: each
loader cuts this rank's rows (or block-aligned columns) of the blocks, and `finish_loading` puts
the parts together as one `PackedWeight`, or one per run of rows of the same format where the
checkpoint mixes formats in a fused weight (a K-quant file's Q6_K v beside Q4_K q and k). A part
that cannot stay packed (columns off its blocks, a fused weight with a dense shard) is dequantized.
"""

import torch
from torch import nn

from compiled_engine.layers.moe import FusedMoE
from compiled_engine.layers.weight_utils import (
    PackedSource,
    WeightSource,
    check_shape,
    dense,
    narrow,
    source_shape,
)
from compiled_engine.parallel import parallel_state as ps
from kernels import ops
from kernels.packed import FORMATS, PackedWeight, quantize


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


Weight = nn.Parameter | PackedWeight | nn.ModuleList  # the last: packed runs of rows


def packed_runs(parts: dict[int, PackedSource]) -> list[PackedWeight]:
    """Parts keyed by their first row -> one PackedWeight per run of rows of one format."""
    runs: list[list[PackedSource]] = []
    for _, part in sorted(parts.items()):
        if runs and runs[-1][0].format == part.format:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [
        PackedWeight(torch.cat([p.blocks for p in run]), run[0].format, run[0].shape[1])
        for run in runs
    ]


class LinearBase(nn.Module):
    """What the column- and row-parallel linears share: the weight (dense or packed), its loaders,
    the matmul and the LoRA adapters' slots."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.get_tp_rank(), ps.get_tp_size()
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight: Weight = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self._packed_parts: dict[int, PackedSource] = {}  # first row -> part, until finish_loading
        # LoRA (`compiled_engine.lora.slots`): the adapter slots' A [S, P*R, in] and B [S, P*R, out]
        # of this rank, P the projections an adapter may target here (q, k, v: 3), R the max rank
        # (buffers: the graphs take them as inputs, as they do the weights)
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_part_rows: tuple[int, ...] = ()  # where each part's rows of B start, and the end

    # the shard ids of the projections an adapter may target in this layer, in B's column order
    lora_parts: tuple[object, ...] = (None,)

    def out_rows(self, shard_id: object) -> tuple[int, int, int]:
        """Where projection `shard_id`'s rows of this rank are: (first row here, first row in the
        full projection, rows)."""
        return 0, 0, self.out_features

    def in_cols(self) -> tuple[int, int]:
        """This rank's input features: (first column of the full input, columns)."""
        return 0, self.in_features

    def with_lora(self, x: torch.Tensor, y: torch.Tensor,
                  lora: torch.Tensor | None) -> torch.Tensor:
        """`y` plus the adapters' delta of each token (`lora`: its slot, or None: no adapter in the
        step)."""
        if lora is None or self.lora_a is None:
            return y
        b = self.lora_b.transpose(1, 2)  # stored [S, P*R, out]: the op takes [S, out, P*R]
        return y + ops.lora_delta(x, self.lora_a, b, lora, self.lora_part_rows)

    def shard(self, src: WeightSource, shard_id: object) -> tuple[int, WeightSource]:
        """This rank's part of a checkpoint weight and the first row it fills."""
        raise NotImplementedError

    def weight_loader(
        self, param: nn.Parameter, src: WeightSource, shard_id: object = None
    ) -> None:
        if param is self.bias:
            self.load_bias(src, shard_id)
            return
        row, part = self.shard(src, shard_id)
        if isinstance(part, PackedSource):
            self._packed_parts[row] = part
        else:
            param.data[row : row + source_shape_rows(part)].copy_(part[:])

    def load_bias(self, src: WeightSource, shard_id: object) -> None:
        row, part = self.shard(src, shard_id)
        self.bias.data[row : row + source_shape_rows(part)].copy_(dense(part))

    def finish_loading(self) -> None:
        """Put the packed parts together (after every tensor of the checkpoint is in)."""
        parts, self._packed_parts = self._packed_parts, {}
        if not parts:
            return
        if sum(p.shape[0] for p in parts.values()) < self.weight.shape[0]:
            for row, part in parts.items():  # a dense shard beside them: all dense
                self.weight.data[row : row + part.shape[0]].copy_(part.dequantize())
            return
        runs = packed_runs(parts)
        del self.weight
        self.weight = runs[0] if len(runs) == 1 else nn.ModuleList(runs)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(self.weight, nn.ModuleList):
            out = torch.cat(
                [ops.linear(x, w, invariant=self.batch_invariant) for w in self.weight], dim=-1
            )
            return out if bias is None else out + bias
        return ops.linear(x, self.weight, bias, self.batch_invariant)


def source_shape_rows(src: WeightSource) -> int:
    return source_shape(src)[0]


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, ps.get_tp_size(), "out_features"), bias)
        self.full_out = out_features

    def full_rows(self, shard_id: object) -> int:
        """Rows of projection `shard_id` across the ranks."""
        return self.full_out

    def out_rows(self, shard_id: object) -> tuple[int, int, int]:
        rows = self.full_out // self.tp_size
        return 0, self.tp_rank * rows, rows

    def shard(self, src: WeightSource, shard_id: object) -> tuple[int, WeightSource]:
        check_shape(src, (self.full_rows(shard_id), *self.in_shape(src)))
        offset, start, rows = self.out_rows(shard_id)
        return offset, narrow(src, 0, start, rows)

    def in_shape(self, src: WeightSource) -> tuple[int, ...]:
        """The input dims a source of this layer has (none for a bias)."""
        return (self.weight.shape[1],) if len(source_shape(src)) == 2 else ()

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        return self.with_lora(x, self.matmul(x, self.bias), lora)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up); `shard_id` indexes
    `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes = sizes
        self.lora_parts = tuple(range(len(sizes)))

    def full_rows(self, shard_id: object) -> int:
        assert isinstance(shard_id, int)
        return self.sizes[shard_id]

    def out_rows(self, shard_id: object) -> tuple[int, int, int]:
        assert isinstance(shard_id, int)
        rows = self.sizes[shard_id] // self.tp_size
        offset = sum(self.sizes[:shard_id]) // self.tp_size
        return offset, self.tp_rank * rows, rows


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

    lora_parts = ("q", "k", "v")

    def full_rows(self, shard_id: object) -> int:
        return self.full_sizes[shard_id]

    def out_rows(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id == "q":
            offset, rows, head0 = 0, self.q_size, self.tp_rank * self.num_heads
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, head0 = self.kv_size, (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        return offset, head0 * self.head_dim, rows


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, ps.get_tp_size(), "in_features"), out_features, bias)
        self.full_in = in_features

    def load_bias(self, src: WeightSource, shard_id: object) -> None:
        # replicated, added once after the reduction
        check_shape(src, tuple(self.bias.shape))
        self.bias.data.copy_(dense(src))

    def full_rows(self, shard_id: object) -> int:
        return self.out_features

    def in_cols(self) -> tuple[int, int]:
        cols = self.full_in // self.tp_size
        return self.tp_rank * cols, cols

    def shard(self, src: WeightSource, shard_id: object) -> tuple[int, WeightSource]:
        check_shape(src, (self.weight.shape[0], self.full_in))
        start, cols = self.in_cols()
        if isinstance(src, PackedSource) and not src.splits_at(1, cols):
            src = src.dequantize()  # this rank's columns would cut its blocks
        return 0, narrow(src, 1, start, cols)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        """The adapters' delta of this rank's input columns joins the partial sum before the
        all-reduce (A is split as the input, B whole)."""
        y = ps.all_reduce(self.with_lora(x, self.matmul(x, None), lora),
                          ordered=self.batch_invariant)
        return y if self.bias is None else y + self.bias


# `--quantization` -> the block format its linears are quantized to
QUANTIZATIONS = {"int8": "I8", "int4": "I4"}


def quantize_linears(model: nn.Module, quantization: str) -> None:
    """Weight-only `int8` / `int4` (group-wise round-to-nearest, groups of 32 along K, bf16
    scales) of every dense linear weight of the model (this rank's shard), the experts of a
    mixture of experts included, after loading. Packed weights stay as they are; the embedding (and
    a tied LM head) stay dense."""
    fmt = FORMATS[QUANTIZATIONS[quantization]]
    for module in list(model.modules()):
        if isinstance(module, FusedMoE):
            module.quantize(fmt)
            continue
        weight = getattr(module, "weight", None)
        if (isinstance(module, LinearBase) and isinstance(weight, nn.Parameter)
                and weight.shape[1] % fmt.block == 0):
            del module.weight
            module.weight = quantize(weight.data, fmt)
