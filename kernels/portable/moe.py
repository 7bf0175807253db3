"""The portable fused mixture-of-experts MLP: tokens sorted by expert, one GEMM per projection per
expert with tokens (gate and up fused in one), the weighted sum back in token order. Either
projection's experts may be dense [E, N, K] or packed ([E, N, row_bytes] blocks of a
`kernels.packed` format): a packed expert goes through `kernels::linear_packed`, so on the CPU with
bf16 activations the native packed kernel reads its blocks as they are.

Deterministic by construction: each (token, expert) row goes through `kernels::linear` (batch-
invariant with `invariant`: a row's product never depends on which other tokens share its expert),
and each token's k expert outputs are added in its own slot order (no atomics, no scatter-add).
Each call adds its tokens per expert to the layer's load (`kernels.expert_load`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import expert_load
from kernels.packed import BY_CODE

# Stacked expert weights -> one persistent view per expert: the native `kernels::linear` prepares a
# CPU weight once per tensor object (its cache is keyed by the tensor), so a fresh `w[e]` view per
# call would be prepared again at every step. Keyed by the weight's id, dropped with the weight.
_experts: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}


def _expert_views(w: torch.Tensor) -> list[torch.Tensor]:
    entry = _experts.get(id(w))
    if entry is not None and entry[0]() is w:
        return entry[1]
    key, views = id(w), list(w.unbind(0))
    _experts[key] = (weakref.ref(w, lambda _: _experts.pop(key, None)), views)
    return views


def expert_rows(w: torch.Tensor, format: int) -> int:
    """Output rows of each expert of a stacked projection: dense [E, N, K], or packed (`format`
    >= 0) [E, N / rows, rows * row_bytes] blocks."""
    return w.shape[1] * (BY_CODE[format].rows if format >= 0 else 1)


def _projection(w: torch.Tensor, format: int, in_features: int,
                invariant: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """(rows, expert) -> the rows times that expert's weight, through the linear op its form
    takes."""
    views = _expert_views(w)
    if format < 0:
        linear = torch.ops.kernels.linear.default
        return lambda rows, e: linear(rows, views[e], None, invariant)
    packed = torch.ops.kernels.linear_packed.default
    return lambda rows, e: packed(rows, views[e], format, in_features, None, invariant)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    invariant: bool = False,
    w13_format: int = -1,
    w2_format: int = -1,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I] (either as blocks of
    its `_format`, -1: dense); topk_weights, topk_ids [T, k] -> [T, H]: sum_j topk_weights[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j], in x's dtype."""
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert; within one, in (token, slot) order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    inter = expert_rows(w13, w13_format) // 2
    gate_up = _projection(w13, w13_format, x.shape[-1], invariant)
    down = _projection(w2, w2_format, inter, invariant)
    expert_load.record(w13, counts)
    rows = x.index_select(0, order // k)
    out = torch.empty(tokens * k, expert_rows(w2, w2_format), dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = gate_up(rows[start : start + n], expert).chunk(2, -1)
        out[order[start : start + n]] = down(F.silu(gate) * up, expert)
        start += n
    return combine(out, topk_weights)


def combine(out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs (`out` [T*k, H], in (token, slot) order) weighted and added
    in slot order: the same sum whatever the token's batch (no atomics)."""
    tokens, k = topk_weights.shape
    weighted = out.view(tokens, k, -1) * topk_weights.to(out.dtype)[:, :, None]
    total = weighted[:, 0]
    for j in range(1, k):
        total = total + weighted[:, j]
    return total
