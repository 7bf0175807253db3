"""The portable fused mixture-of-experts MLP: tokens sorted by expert, one GEMM per projection per
expert with tokens (gate and up fused in one), the weighted sum back in token order.

Deterministic by construction: each (token, expert) row goes through `kernels::linear` (batch-
invariant with `invariant`: a row's product never depends on which other tokens share its expert),
and each token's k expert outputs are added in its own slot order (no atomics, no scatter-add)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# Stacked expert weights -> one persistent view per expert: the native `kernels::linear` prepares a
# CPU weight once per tensor object (its cache is keyed by the tensor), so a fresh `w[e]` view per
# call would be prepared again at every step. Keyed by the weight's id, dropped with the weight.
_experts: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}
# A layer's w13 (by id) -> the tokens each of its experts has computed so far (`expert_tokens`)
_tokens: dict[int, list[int]] = {}


def expert_tokens(w13: torch.Tensor) -> list[int]:
    """How many tokens each expert of the layer holding `w13` has computed (totals, this
    process)."""
    return list(_tokens.get(id(w13)) or [0] * w13.shape[0])


def reset_expert_tokens(w13: torch.Tensor) -> None:
    _tokens.pop(id(w13), None)


def _expert_views(w: torch.Tensor) -> list[torch.Tensor]:
    entry = _experts.get(id(w))
    if entry is not None and entry[0]() is w:
        return entry[1]
    key, views = id(w), list(w.unbind(0))

    def forget(_: weakref.ref) -> None:
        _experts.pop(key, None)
        _tokens.pop(key, None)

    _experts[key] = (weakref.ref(w, forget), views)
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
    load = _tokens.setdefault(id(w13), [0] * len(counts))
    for expert, n in enumerate(counts):
        load[expert] += n
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
    weighted = out.view(tokens, k, -1) * topk_weights.to(x.dtype)[:, :, None]
    total = weighted[:, 0]
    for j in range(1, k):
        total = total + weighted[:, j]
    return total
