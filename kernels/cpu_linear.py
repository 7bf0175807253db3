"""`F.linear` for CPU bf16 weights on a copy of the weight prepared once: torch's plain bf16 linear re-packs
the weight into oneDNN's blocked layout on every call, and where the CPU has no bf16 GEMM (AVX2-only x86,
most ARM) it runs a slow generic loop. This is the torch implementation of `kernels::cpu_linear`: where the
native library loads, its C++ kernel (torch_ops.cpp: the AMX kernel, packed weights cached in C++) serves
the op and comes here only for what it declines; without the library this serves it.

The copy, by what the CPU has:
    amx      the native kernel's panel layout (`cpu_native`)
    onednn   oneDNN's own packed layout (what inductor's freezing does): AVX512-BW/VL/DQ or AVX-NE-CONVERT
    fp32     an fp32 copy: the product runs in torch's fp32 GEMM (MKL / OpenBLAS) on upcast inputs and is
             rounded to bf16, several times faster there than the bf16 loop (docs/benchmarks.md)
It is made on the first call and kept on the weight tensor (memory: the bf16 weights twice over, or three
times with the fp32 copy); an in-place change of the weight (its version counter) redoes it. fp32 weights
keep torch's MKL path, which is faster there."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from kernels import cpu_native

_ATTR = "_compiled_engine_packed"


@torch.compiler.assume_constant_result
def packing_available() -> bool:
    """Whether bf16 linears should take this op: always, unless a graph is being frozen (inductor's
    freezing packs constant weights itself, and max-autotune then picks its own GEMM templates: an opaque
    op would hide the linears from both). A constant to torch.compile, read while tracing."""
    return not inductor_config.freezing


def onednn_bf16_available() -> bool:
    """Whether oneDNN packs and runs bf16 linears here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT;
    elsewhere its reorder raises."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _prepared(weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(kind, copy): see the module docstring; made on first use and again after an in-place change."""
    version, kind, copy = getattr(weight, _ATTR, (None, "", None))
    if version != weight._version:
        copy = cpu_native.pack_bf16_weight(weight)
        kind = "amx"
        if copy is None and onednn_bf16_available():
            kind, copy = "onednn", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        elif copy is None and torch.backends.mkldnn.is_available():
            kind, copy = "fp32", torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), 1)
        elif copy is None:
            kind, copy = "fp32-blas", weight.detach().float()
        setattr(weight, _ATTR, (weight._version, kind, copy))
    return kind, copy


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    kind, copy = _prepared(weight)
    if kind == "amx":
        return cpu_native.linear_bf16(x, copy, bias, weight.shape[0])
    if kind == "fp32-blas":
        return F.linear(x.float(), copy, None if bias is None else bias.float()).to(torch.bfloat16)
    if kind == "fp32":
        rows = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.mkldnn._linear_pointwise(rows, copy, None if bias is None else bias.float(), "none", [], "")
        return out.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0])
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), copy, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
