"""`F.linear` for CPU bf16 weights on weights packed once: torch's plain bf16 linear re-packs the weight
into oneDNN's blocked layout on every call. This is the torch implementation of `kernels::cpu_linear`:
where the native library loads, its C++ kernel (torch_ops.cpp: the AMX kernel, packed weights cached in
C++) serves the op and comes here only for what it declines; without the library this serves it. Where
the CPU has AMX, the native kernel of `cpu_native`; elsewhere oneDNN on its own packed layout (what
inductor's freezing does). The packed copy is made on the first call and kept on the weight tensor (so
the bf16 weights take twice their memory); an in-place change of the weight (its version counter)
repacks it. fp32 keeps torch's MKL path, which is faster there."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from kernels import cpu_native

_ATTR = "_compiled_engine_packed"


@torch.compiler.assume_constant_result
def packing_available() -> bool:
    """Whether bf16 linears should take this path: a packed kernel exists here (AMX or oneDNN), and no
    graph is being frozen (inductor's freezing packs constant weights itself, and max-autotune then picks
    its own GEMM templates: an opaque op would hide the linears from both). A constant to torch.compile,
    read while tracing."""
    return (cpu_native.amx_available() or onednn_bf16_available()) and not inductor_config.freezing


def onednn_bf16_available() -> bool:
    """Whether oneDNN packs and runs bf16 linears here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT;
    elsewhere (AVX2-only x86, ARM) its reorder raises and torch's own bf16 linear serves."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed(weight: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """(is the AMX layout, the packed weight or None without a packed kernel), packed on first use and
    again after an in-place change."""
    version, amx, packed = getattr(weight, _ATTR, (None, False, None))
    if version != weight._version:
        packed = cpu_native.pack_bf16_weight(weight)
        amx = packed is not None
        if not amx and onednn_bf16_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        setattr(weight, _ATTR, (weight._version, amx, packed))
    return amx, packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    amx, packed = _packed(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if amx:
        return cpu_native.linear_bf16(x, packed, bias, weight.shape[0])
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
