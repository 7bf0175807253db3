"""Decode batch-size buckets: each gets a static-shape graph (a CUDA graph on a GPU)."""

from __future__ import annotations

import bisect


def default_buckets(max_batch: int) -> list[int]:
    """`[1, 2, 4] + range(8, max_batch + 1, 8)` as mini-sglang, capped at `max_batch` (none for
    0)."""
    if max_batch < 1:
        return []
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sizes


def next_bucket(buckets: list[int], n: int) -> int | None:
    """Smallest bucket >= n, or None when n is beyond the largest (that batch runs uncaptured)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def parse_buckets(text: str) -> list[int]:
    """`"1,2,4,8"` -> [1, 2, 4, 8] (sorted, unique, positive)."""
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise ValueError(f"buckets must be positive integers, got {text!r}")
    return values
