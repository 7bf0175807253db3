"""The portable fused mixture-of-experts MLP: tokens sorted by expert, one GEMM per projection per
expert with tokens (gate and up fused in one), the weighted sum back in token order.

Deterministic by construction: each (token, expert) row goes through `kernels::linear` (batch-
invariant with `invariant`: a row's product never depends on which other tokens share its expert),
and each token's k expert outputs are added in its own slot order (no atomics, no scatter-add).
Each call adds its tokens per expert to the layer's load (`kernels.expert_load`)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kernels import expert_load

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


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    invariant: bool = False,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights, topk_ids
    [T, k] -> [T, H]: sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e =
    topk_ids[t, j], in x's dtype."""
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert; within one, in (token, slot) order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    up_projs, down_projs = _expert_views(w13), _expert_views(w2)
    expert_load.record(w13, counts)
    rows = x.index_select(0, order // k)
    out = torch.empty(tokens * k, w2.shape[1], dtype=x.dtype, device=x.device)
    linear = torch.ops.kernels.linear.default
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = linear(rows[start : start + n], up_projs[expert], None, invariant).chunk(2, -1)
        out[order[start : start + n]] = linear(F.silu(gate) * up, down_projs[expert], None,
                                               invariant)
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
