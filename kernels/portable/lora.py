"""LoRA's batched delta in torch: each token's adapter gathered by its slot, batched GEMVs (the
shrink, then the expand of each projection's block of B). Where the native CPU kernels do not load,
it is traced into the graphs, where inductor reads the gathered rows in place (a batched
matrix-vector product is a reduction it fuses); each token's result is computed from its own row
and adapter only, whatever else shares the step."""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               part_rows: tuple[int, ...]) -> torch.Tensor:
    """x [T, K], a [S, R, K], b [S, N, R] (the scaling folded in), slots [T] -> [T, N]: token t's
    `b[slots[t]] @ (a[slots[t]] @ x[t])`, B's rows part_rows[p]:part_rows[p + 1] reading only the
    p-th R / P columns (B is zero elsewhere). Slot -1 is the last one, which the caller keeps zero
    (tokens without an adapter)."""
    shrunk = torch.bmm(a[slots], x.unsqueeze(-1))  # [T, R, 1]
    width = a.shape[1] // (len(part_rows) - 1)
    parts = [
        torch.bmm(b[slots, lo:hi, p * width:(p + 1) * width],
                  shrunk[:, p * width:(p + 1) * width])
        for p, (lo, hi) in enumerate(zip(part_rows, part_rows[1:]))
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).squeeze(-1)
