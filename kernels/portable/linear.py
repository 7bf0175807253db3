"""The portable linear: torch's own. The native `kernels::linear` (native/torch_ops.cpp) prepares each CPU
bf16 weight once for the fastest GEMM the CPU has; without the native library, bf16 linears run torch's bf16
GEMM, which is slow on CPUs without AVX512-BF16 or AMX."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
