"""Each mixture-of-experts layer's load: how many tokens each of its experts has computed,
recorded by `kernels::fused_moe` as it runs (a host list on the CPU; a device tensor on CUDA, added
to without a host sync so that captured graphs record it too). Keyed by the layer's stacked w13
weight, dropped with it."""

from __future__ import annotations

import weakref

import torch

_totals: dict[int, tuple[weakref.ref, list[int] | torch.Tensor]] = {}


def record(w13: torch.Tensor, counts: list[int] | torch.Tensor) -> None:
    """Add one call's tokens per expert."""
    key = id(w13)
    entry = _totals.get(key)
    if entry is None or entry[0]() is not w13:
        start = torch.zeros_like(counts) if isinstance(counts, torch.Tensor) else [0] * len(counts)
        entry = _totals[key] = (weakref.ref(w13, lambda _: _totals.pop(key, None)), start)
    total = entry[1]
    if isinstance(total, torch.Tensor):
        total.add_(counts)
    else:
        for expert, n in enumerate(counts):
            total[expert] += n


def tokens(w13: torch.Tensor) -> list[int]:
    entry = _totals.get(id(w13))
    if entry is None or entry[0]() is not w13:
        return [0] * w13.shape[0]
    total = entry[1]
    return total.tolist() if isinstance(total, torch.Tensor) else list(total)


def reset(w13: torch.Tensor) -> None:
    entry = _totals.get(id(w13))
    if entry is not None and isinstance(entry[1], torch.Tensor):
        # the tensor a captured graph adds to stays the same; made in the warm-up's inference mode,
        # it is written in that mode only
        with torch.inference_mode():
            entry[1].zero_()
    elif entry is not None:
        _totals.pop(id(w13), None)
