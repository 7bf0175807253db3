"""Deterministic mode on a model: each layer that calls a kernel op keeps `batch_invariant`, a plain
bool it passes to its ops as their `invariant` argument (a constant of the traced graphs, which
dynamo guards on), so the mode is an explicit property of the model, not a global the ops read."""

from __future__ import annotations

from torch import nn


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """Every row's result then depends on that row (and its keys) only: see `kernels.ops`'
    `invariant`."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = on
