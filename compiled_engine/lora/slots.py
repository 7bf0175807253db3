"""The device's adapter slots, inside the model's linears: each targetable linear holds A
[S + 1, P*R, in] and B stored transposed, [S + 1, P*R, out], of this rank (S slots, a last one of
zeros for tokens without an adapter, P the projections an adapter may target there, R the largest
rank), sharded as the linear's own weight: A as its input, B as its output. B transposed: the
expand then reads along the output, which the CPU's vectorized loops and CUDA's loads want."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compiled_engine.layers.linear import LinearBase, RowParallelLinear
from compiled_engine.lora.weights import AdapterError, AdapterWeights


@dataclass(frozen=True, slots=True)
class Target:
    """One projection an adapter may target: its linear and which of the linear's parts it is."""

    layer: LinearBase
    part: int  # index of its columns in B (`LinearBase.lora_parts`)
    shard_id: object

    def full_shape(self) -> tuple[int, int]:
        """The projection's (in, out) features over all ranks (an adapter's A and B span them)."""
        layer = self.layer
        full_in = layer.full_in if isinstance(layer, RowParallelLinear) else layer.in_features
        return full_in, layer.full_rows(self.shard_id)


class LoRASlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[str, Target] = {}  # checkpoint module path -> its target
        by_fused: dict[str, list[tuple[str, object]]] = {}
        for name, (fused, shard_id) in getattr(model, "packed_modules", {}).items():
            by_fused.setdefault(fused, []).append((name, shard_id))
        for path, layer in model.lora_linears().items():
            head, _, leaf = path.rpartition(".")
            for name, shard_id in by_fused.get(leaf, [(leaf, None)]):
                part = layer.lora_parts.index(shard_id)
                self.targets[f"{head}.{name}"] = Target(layer, part, shard_id)
            rows = [layer.out_rows(shard_id) for shard_id in layer.lora_parts]
            layer.lora_part_rows = (*(offset for offset, _, _ in rows), rows[-1][0] + rows[-1][2])
            width = len(layer.lora_parts) * max_rank
            layer.lora_a = torch.zeros(max_loras + 1, width, layer.in_features, dtype=dtype,
                                       device=device)
            layer.lora_b = torch.zeros(max_loras + 1, width, layer.out_features, dtype=dtype,
                                       device=device)
        self.layers = list(model.lora_linears().values())
        self.num_layers = getattr(model, "num_layers", 0)  # decoder layers (a GGUF's blocks)

    def heads(self) -> dict[str, int]:
        """Attention heads of q_proj and k_proj (all ranks'): a GGUF adapter's rows of them come
        permuted as the base model's (`models.gguf_checkpoint.unpermute_rotary_rows`)."""
        qkv = next(t.layer for p, t in self.targets.items() if p.endswith("q_proj"))
        return {"q_proj": qkv.full_rows("q") // qkv.head_dim,
                "k_proj": qkv.full_rows("k") // qkv.head_dim}

    def max_adapter_bytes(self) -> int:
        """The bytes of the largest adapter this model serves (every module, rank `max_rank`, in
        fp32): no adapter file's tensors are larger."""
        return 4 * self.max_rank * sum(sum(t.full_shape()) for t in self.targets.values())

    def check(self, weights: AdapterWeights, name: str) -> None:
        """AdapterError unless `weights` fits: every module a target of this model, shapes those of
        the projections, the rank at most `max_rank`."""
        if weights.rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} has rank {weights.rank}, above the server's "
                               f"--max-lora-rank {self.max_rank}")
        for path, (a, b) in weights.modules.items():
            target = self.targets.get(path)
            if target is None:
                raise AdapterError(f"adapter {name!r} targets {path!r}, which this model does not "
                                   "have (or serves no adapter on)")
            full_in, out = target.full_shape()
            if a.shape[1] != full_in or b.shape[0] != out:
                raise AdapterError(f"adapter {name!r}: {path!r} maps {a.shape[1]} -> {b.shape[0]} "
                                   f"features, the model's projection {full_in} -> {out}")

    def load(self, slot: int, weights: AdapterWeights | None) -> None:
        """Put `weights` (checked) in slot `slot` of every linear; None empties it."""
        for layer in self.layers:
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
        if weights is None:
            return
        r = self.max_rank
        for path, (a, b) in weights.modules.items():
            target = self.targets[path]
            layer, col = target.layer, target.part * r
            start, cols = layer.in_cols()
            offset, first, rows = layer.out_rows(target.shard_id)
            rank = a.shape[0]  # (a GGUF file may give each module its own)
            a_slot, b_slot = layer.lora_a[slot], layer.lora_b[slot]
            a_slot[col : col + rank].copy_(a[:, start : start + cols])
            b_slot[col : col + rank, offset : offset + rows].copy_(b[first : first + rows].T)
