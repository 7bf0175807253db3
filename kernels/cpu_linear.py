"""`F.linear` for CPU bf16 weights through oneDNN on pre-packed weights (what inductor's freezing does):
torch's plain bf16 linear re-packs the weight into oneDNN's blocked layout on every call: the packed path
is about 1.25x faster at 1 to 64 rows (`python -m kernels.bench --linear`). The packed copy is made on the first
call and kept on the weight tensor (so the bf16 weights take twice their memory); an in-place change of
the weight (its version counter) repacks it. fp32 keeps torch's MKL path, which is faster there."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

_ATTR = "_compiled_engine_packed"


@torch.compiler.assume_constant_result
def packing_available() -> bool:
    """Whether bf16 linears should take this path: oneDNN is in this torch build, and no graph is being
    frozen (inductor's freezing packs constant weights itself, and max-autotune then picks its own GEMM
    templates: an opaque op would hide the linears from both). A constant to torch.compile, read while
    tracing."""
    return torch.backends.mkldnn.is_available() and not inductor_config.freezing


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return F.linear(x, weight, bias)
    version, packed = getattr(weight, _ATTR, (None, None))
    if version != weight._version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        setattr(weight, _ATTR, (weight._version, packed))
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
