"""An adapter's weights on the host, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the projections an adapter may target (Hugging Face's module names)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be served (the message says why): unreadable, an unsupported
    option, a module the model does not have, wrong shapes, a rank above the limit."""


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """`modules`: each targeted module (its checkpoint path, e.g. `model.layers.0.self_attn.q_proj`)
    -> (A [r, in], B [out, r]) in fp32, the scaling already in B."""

    rank: int  # the largest of its modules'
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class AdapterTargets:
    """What a model lets an adapter hold, checked before a file's data is read."""

    projections: dict[str, tuple[int, int]]  # module path -> its (in, out) features, all ranks'
    max_rank: int
    heads: dict[str, int]  # attention heads of q_proj and k_proj (`LoRASlots.heads`)
    num_layers: int  # decoder layers
