"""Portable torch implementations of paged attention and the KV store: the CPU where the native
kernels do not load or decline an input (soft caps, sliding windows, other dtypes), and any device
without kernels.

K/V are gathered through the page table into a reused workspace (fresh multi-MB allocations
page-fault on every call, which costs more than the attention itself), then attended with SDPA (GQA
through `enable_gqa`, so KV heads are never repeated).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_WORKSPACE_BYTES = 1 << 30  # a larger gather gets a one-off buffer instead of being kept

_workspaces: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    key = (like.dtype, like.device)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        if numel * like.element_size() <= MAX_WORKSPACE_BYTES:
            _workspaces[key] = buf
    return buf[:numel]


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V at `slots` [..., L] as [..., Hkv, L, D] views of the workspace."""
    flat = slots.reshape(-1)
    row_shape = k_cache.shape[1:]
    buf = _workspace(2 * flat.numel() * row_shape.numel(), k_cache).view(
        2, flat.numel(), *row_shape
    )
    torch.index_select(k_cache, 0, flat, out=buf[0])
    torch.index_select(v_cache, 0, flat, out=buf[1])
    k, v = buf.view(2, *slots.shape, *row_shape).unbind(0)
    return k.transpose(-3, -2), v.transpose(-3, -2)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """GQA softmax attention of q [..., H, M, D] over k, v [..., Hkv, L, D]. `mask` (True = attend)
    broadcasts to [..., 1, M, L]; None means causal with M == L."""
    if soft_cap <= 0:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=mask is None, enable_gqa=True
        )
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    grouped = q.float().unflatten(-3, (k.shape[-3], -1))
    scores = torch.matmul(grouped, k.float().unsqueeze(-3).transpose(-1, -2)) * scale
    scores = (soft_cap * torch.tanh(scores / soft_cap)).masked_fill(
        ~mask.unsqueeze(-3), float("-inf")
    )
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float().unsqueeze(-3))
    return out.flatten(-4, -3).to(q.dtype)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    keep = slots >= 0
    if bool(keep.all()):
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
    else:
        k_cache[slots[keep]] = k[keep]
        v_cache[slots[keep]] = v[keep]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    if invariant:  # a decode step is an extend of one token per row
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return invariant_attention(
            q, k_cache, v_cache, page_table, cu, seq_lens, scale, sliding_window, soft_cap
        )
    batch = q.shape[0]
    lens = seq_lens.long()
    start = (lens - sliding_window).clamp(min=0) if sliding_window > 0 else torch.zeros_like(lens)
    span = int((lens - start).max()) if batch else 0
    if span == 0:
        return torch.zeros_like(q)
    pos = start[:, None] + torch.arange(span, device=q.device)
    valid = pos < lens[:, None]
    slots = page_table.gather(1, pos.clamp(max=page_table.shape[1] - 1)).long().clamp(min=0)
    k, v = _gather_kv(k_cache, v_cache, torch.where(valid, slots, 0))
    out = _attend(q[:, :, None], k, v, valid[:, None, None, :], scale, soft_cap)[:, :, 0]
    return torch.where((lens > 0)[:, None, None], out, 0)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """Requests with a cached prefix and of similar shapes share one padded SDPA call (many short
    suffixes over a shared system prompt: faster than one by one, docs/benchmarks.md); others attend
    one by one."""
    if invariant:
        return invariant_attention(
            q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap
        )
    out = torch.zeros_like(q)
    cu, lens = cu_q_lens.tolist(), seq_lens.tolist()
    reqs = [
        _Req(b, cu[b], cu[b + 1] - cu[b], lens[b]) for b in range(len(lens)) if cu[b + 1] > cu[b]
    ]
    for group in _attention_groups(reqs, sliding_window):
        if len(group) == 1:
            _extend_one(
                out, q, k_cache, v_cache, page_table, group[0], scale, sliding_window, soft_cap
            )
        else:
            _extend_padded(out, q, k_cache, v_cache, page_table, group, scale, soft_cap)
    return out


def invariant_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale: float,
                        sliding_window: int, soft_cap: float) -> torch.Tensor:
    """Batch-invariant attention (deterministic mode) without the native kernel: each query token on
    its own, the same call for it whatever its batch, chunk or step kind. Correct anywhere, and
    slow."""
    out = torch.zeros_like(q)
    cu, lens = cu_q_lens.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        for row in range(cu[b], cu[b + 1]):
            end = seq_len - (cu[b + 1] - row) + 1  # this query's position + 1
            if end <= 0:
                continue
            start = max(0, end - sliding_window) if sliding_window > 0 else 0
            k, v = _gather_kv(k_cache, v_cache, page_table[b, start:end].long())
            every = torch.ones(1, end - start, dtype=torch.bool, device=q.device)
            out[row] = _attend(q[row, :, None][None], k[None], v[None], every, scale, soft_cap)[
                0, :, 0
            ]
    return out


@dataclass(frozen=True)
class _Req:
    row: int  # page-table row
    q_start: int
    q_len: int
    seq_len: int


# A group's padded attention ([n, q_max, kv_max]) may cost this much more than its requests' own.
_PADDING_SLACK = 1.25


def _attention_groups(reqs: list[_Req], sliding_window: int) -> list[list[_Req]]:
    """The SDPA calls: prompts without a prefix alone (SDPA's causal path skips the masked half, a
    padded masked call would compute the whole square), and so everything under a sliding window;
    requests with a prefix in `_similar_groups`."""
    if sliding_window > 0:
        return [[r] for r in reqs]
    return [[r] for r in reqs if r.seq_len == r.q_len] + _similar_groups(
        [r for r in reqs if r.seq_len > r.q_len]
    )


def _similar_groups(reqs: list[_Req]) -> list[list[_Req]]:
    """Consecutive runs (by query length, then length) whose padded attention stays within the
    slack."""
    groups: list[list[_Req]] = []
    cost = 0
    for r in sorted(reqs, key=lambda r: (r.q_len, r.seq_len)):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * r.q_len * r.seq_len  # sorted: r has the largest of both
            if padded <= _PADDING_SLACK * (cost + r.q_len * r.seq_len):
                group.append(r)
                cost += r.q_len * r.seq_len
                continue
        groups.append([r])
        cost = r.q_len * r.seq_len
    return groups


def _extend_one(out, q, k_cache, v_cache, page_table, r: _Req, scale: float, sliding_window: int,
                soft_cap: float) -> None:
    prefix = r.seq_len - r.q_len
    kv_lo = max(0, r.seq_len - r.q_len + 1 - sliding_window) if sliding_window > 0 else 0
    k, v = _gather_kv(k_cache, v_cache, page_table[r.row, kv_lo : r.seq_len].long())
    mask = None
    if prefix > 0 or kv_lo > 0 or 0 < sliding_window < r.q_len:
        q_pos = torch.arange(prefix, r.seq_len)[:, None]
        kv_pos = torch.arange(kv_lo, r.seq_len)[None, :]
        mask = kv_pos <= q_pos
        if sliding_window > 0:
            mask &= kv_pos > q_pos - sliding_window
    # 4-D inputs: SDPA sends 3-D ones to its slow math fallback.
    q_end = r.q_start + r.q_len
    attended = _attend(
        q[None, r.q_start : q_end].transpose(1, 2), k[None], v[None], mask, scale, soft_cap
    )
    out[r.q_start : q_end] = attended[0].transpose(0, 1)


def _extend_padded(
    out, q, k_cache, v_cache, page_table, group: list[_Req], scale: float, soft_cap: float
) -> None:
    """Causal attention of a group (no sliding window), padded to its longest query and row. Padding
    queries repeat the request's last one and are dropped; padding positions are masked out."""
    q_max = max(r.q_len for r in group)
    kv_max = max(r.seq_len for r in group)
    rows = torch.tensor([r.row for r in group])
    starts = torch.tensor([r.q_start for r in group])[:, None]
    q_lens = torch.tensor([r.q_len for r in group])[:, None]
    seq_lens = torch.tensor([r.seq_len for r in group])[:, None]
    j = torch.arange(q_max)[None, :]
    tokens = starts + torch.minimum(j, q_lens - 1)  # [n, q_max] rows of q
    k, v = _gather_kv(k_cache, v_cache, page_table[rows, :kv_max].long().clamp(min=0))
    q_pos = (seq_lens - q_lens + j)[:, :, None]
    kv_pos = torch.arange(kv_max)[None, None, :]
    mask = (kv_pos <= q_pos) & (kv_pos < seq_lens[:, :, None])
    # [n, H, q_max, D]
    attended = _attend(q[tokens].transpose(1, 2), k, v, mask[:, None], scale, soft_cap)
    real = j < q_lens
    out.index_copy_(0, tokens[real], attended.transpose(1, 2)[real])
