"""The mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE: a router picks each token's top-k experts
(softmax over the router's logits in float32, top k, renormalized when the config's
`norm_topk_prob` says), one fused op (`kernels.ops.fused_moe`) runs them, and Qwen2-MoE's shared
expert, gated by a sigmoid, is added to every token.

Tensor parallel: each expert's intermediate dimension is split over the ranks (vLLM's default), so
every rank runs every expert on its slice and one all-reduce sums the partial outputs. Expert
parallelism (whole experts per rank) would need an all-to-all that sends each token to the ranks of
its experts and back, and balances load only as well as the router does: not built.

Checkpoints name each expert's projections `...mlp.experts.{e}.{gate,up,down}_proj.weight` (the
Hugging Face layout); `expert_target` maps them onto the fused `w13` / `w2` parameters.

Quantized experts stay packed as the dense linears' weights do (`kernels.packed`): a GGUF file's
expert blocks are stacked as they are into one `PackedWeight` of experts per projection (when every
expert's parts share one format and this rank's slice cuts no block), and `--quantization int8 /
int4` quantizes the experts as it does every linear."""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from compiled_engine.layers.weight_utils import (
    PackedSource,
    WeightSource,
    check_shape,
    narrow,
)
from compiled_engine.parallel import parallel_state as ps
from kernels import ops
from kernels.packed import BlockFormat, PackedWeight, quantize

_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<kind>gate|up|down)_proj\.weight$"
)


def expert_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """A checkpoint expert tensor's name -> (our parameter, (expert, "gate" | "up" | "down")); None
    for any other tensor."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    param = "w2" if m["kind"] == "down" else "w13"
    return f"{m['prefix']}.{param}", (int(m["expert"]), m["kind"])


def expert_checkpoint_names(param_name: str, num_experts: int) -> list[str] | None:
    """The checkpoint tensors a fused expert parameter is loaded from (None: not one)."""
    prefix, _, leaf = param_name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("w13", "w2"):
        return None
    kinds = ("down",) if leaf == "w2" else ("gate", "up")
    return [f"{prefix}.{e}.{k}_proj.weight" for e in range(num_experts) for k in kinds]


_KINDS = {"w13": ("gate", "up"), "w2": ("down",)}


class FusedMoE(nn.Module):
    """The experts of one layer: w13 [E, 2I/tp, H] (gate rows, then up rows), w2 [E, H, I/tp],
    each a parameter or a `PackedWeight` of experts."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.tp_rank, tp = ps.get_tp_rank(), ps.get_tp_size()
        if intermediate_size % tp:
            raise ValueError(
                f"moe_intermediate_size={intermediate_size} is not divisible by tensor-parallel "
                f"size {tp}"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.full_intermediate, self.intermediate = intermediate_size, intermediate_size // tp
        self.hidden_size = hidden_size
        self.batch_invariant = False  # deterministic mode (layers/invariance.py)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False
        )
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader
        self._packed_parts: dict[tuple[str, int], PackedSource] = {}  # until finish_loading

    def weight_loader(self, param: nn.Parameter, src: WeightSource,
                      shard_id: tuple[int, str]) -> None:
        """One expert's gate, up or down projection, this rank's slice of its intermediate dim
        (a packed one kept aside until `finish_loading`)."""
        expert, kind = shard_id
        inter, start = self.intermediate, self.tp_rank * self.intermediate
        if kind == "down":
            check_shape(src, (self.hidden_size, self.full_intermediate))
            if isinstance(src, PackedSource) and not src.splits_at(1, inter):
                src = src.dequantize()  # this rank's columns would cut its blocks
            part = narrow(src, 1, start, inter)
        else:
            check_shape(src, (self.full_intermediate, self.hidden_size))
            part = narrow(src, 0, start, inter)
        if isinstance(part, PackedSource):
            self._packed_parts[kind, expert] = part
        else:
            self._place(param, expert, kind).copy_(part[:])

    def _place(self, param: nn.Parameter, expert: int, kind: str) -> torch.Tensor:
        """Where one expert's projection goes in its dense parameter."""
        if kind == "down":
            return param.data[expert]
        row = self.intermediate if kind == "up" else 0
        return param.data[expert, row : row + self.intermediate]

    def finish_loading(self) -> None:
        """Stack each projection's packed experts into one `PackedWeight` (all of them in one
        format), or dequantize them into the parameter."""
        parts, self._packed_parts = self._packed_parts, {}
        for leaf, kinds in _KINDS.items():
            mine = {key: p for key, p in parts.items() if key[0] in kinds}
            formats = {p.format for p in mine.values()}
            if len(mine) == len(kinds) * self.num_experts and len(formats) == 1:
                stacked = self._stack(mine, kinds, formats.pop())
                delattr(self, leaf)
                setattr(self, leaf, stacked)
                continue
            for (kind, expert), part in mine.items():
                self._place(getattr(self, leaf), expert, kind).copy_(part.dequantize())

    def _stack(self, parts: dict[tuple[str, int], PackedSource], kinds: tuple[str, ...],
               fmt: BlockFormat) -> PackedWeight:
        blocks = torch.stack([torch.cat([parts[kind, e].blocks for kind in kinds])
                              for e in range(self.num_experts)])
        return PackedWeight(blocks, fmt, parts[kinds[0], 0].shape[1])

    def quantize(self, fmt: BlockFormat) -> None:
        """`--quantization`: each dense expert stack (its input dim a multiple of the block) to
        `fmt`'s blocks, after loading."""
        for leaf in _KINDS:
            weight = getattr(self, leaf)
            if isinstance(weight, nn.Parameter) and weight.shape[-1] % fmt.block == 0:
                delattr(self, leaf)
                setattr(self, leaf, quantize(weight.data, fmt))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.batch_invariant)
        return ps.all_reduce(out, ordered=self.batch_invariant)


class ReplicatedLinear(nn.Module):
    """A linear every rank holds whole (the router, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.batch_invariant = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, None, self.batch_invariant)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert, `shared`: a dense MLP)."""

    def __init__(self, config: PretrainedConfig, shared: nn.Module | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            getattr(config, "norm_topk_prob", True),
        )
        self.shared_expert = shared
        self.shared_expert_gate = (
            ReplicatedLinear(config.hidden_size, 1) if shared is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_load(model: nn.Module, reset: bool = False) -> dict[int, list[int]]:
    """Decoder layer -> the tokens each of its experts has computed so far (its mixture-of-experts
    layers only); `reset`: and count from zero again."""
    load = {}
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            layer = int(re.search(r"layers\.(\d+)\.", name)[1])
            load[layer] = ops.expert_tokens(m.w13)
            if reset:
                ops.reset_expert_tokens(m.w13)
    return load


def sparse_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts, by the Hugging Face rule: every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    if not getattr(config, "num_experts", 0):
        return ()
    return tuple(i for i in range(config.num_hidden_layers)
                 if i not in dense_only and (i + 1) % step == 0)
