"""LoRA's batched delta in torch: each token's adapter gathered by its slot, two batched GEMVs
(shrink, then expand). Traceable (the compiled graphs hold it); each token's result is computed
from its own row and adapter only, whatever else shares the step."""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K], b [S, N, R] (the scaling folded in), slots [T] -> [T, N]: token t's
    `b[slots[t]] @ (a[slots[t]] @ x[t])`. Slot -1 is the last one, which the caller keeps zero
    (tokens without an adapter)."""
    shrunk = torch.bmm(a[slots], x.unsqueeze(-1))  # [T, R, 1]
    return torch.bmm(b[slots], shrunk).squeeze(-1)
