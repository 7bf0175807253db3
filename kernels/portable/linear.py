"""The portable linear: torch's own. The native `kernels::linear` (native/torch_ops.cpp) prepares
each CPU bf16 weight once for the fastest GEMM the CPU has; without the native library, bf16 linears
run torch's bf16 GEMM, which is slow on CPUs without AVX512-BF16 or AMX.

Batch-invariant (`invariant=True`, deterministic mode) without the native kernel: one row at a time,
so that every row's product is the same call whatever else is in the batch. Correct anywhere, and
slow."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False
) -> torch.Tensor:
    if not invariant:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, weight, bias)
    out = torch.cat([F.linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
    return out.reshape(*x.shape[:-1], weight.shape[0])
