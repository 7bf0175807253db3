"""Slow, obviously correct paged attention and KV store: per request, per head, fp32 math. Tests
only."""

import torch


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot] = k[t]
            v_cache[slot] = v[t]


def _attend_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: list[int],
    positions: list[int],
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Queries q [n, H, D] at `positions` of one row whose tokens sit at `slots`, one head at a
    time."""
    group = q.shape[1] // k_cache.shape[1]
    index = torch.tensor(slots, dtype=torch.long)
    keys, values = k_cache[index].float(), v_cache[index].float()
    query_pos = torch.tensor(positions)[:, None]
    key_pos = torch.arange(len(slots))[None, :]
    allowed = key_pos <= query_pos
    if sliding_window > 0:
        allowed &= key_pos > query_pos - sliding_window
    out = torch.zeros(q.shape, dtype=torch.float32)
    for h in range(q.shape[1]):
        scores = (q[:, h].float() @ keys[:, h // group].T) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[:, h] = probs @ values[:, h // group]
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len > 0:
            slots = page_table[b, :seq_len].tolist()
            out[b] = _attend_row(
                q[b : b + 1],
                k_cache,
                v_cache,
                slots,
                [seq_len - 1],
                scale,
                sliding_window,
                soft_cap,
            )[0]
    return out.to(q.dtype)


def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32)
    cu = cu_q_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end > start:
            positions = list(range(seq_len - (end - start), seq_len))
            slots = page_table[b, :seq_len].tolist()
            out[start:end] = _attend_row(
                q[start:end], k_cache, v_cache, slots, positions, scale, sliding_window, soft_cap
            )
    return out.to(q.dtype)
