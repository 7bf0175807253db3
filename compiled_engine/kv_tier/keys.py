"""A tier page's key: the chained hash of its prefix's tokens, seeded with a salt of everything that
changes the page's bytes, so that a page is only ever read back where it was written from the same
model, dtype, KV layout, TP rank and adapter, and for a request of the same cache salt."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

from compiled_engine.scheduler.request import SALT_BITS, split_cache_key

FORMAT = 1  # bump when what a page file holds changes


def files_identity(path: str | Path) -> list[tuple[str, int, int]]:
    """A model's or adapter's files as (name, bytes, modification time in ns): rewriting a file
    changes its identity (hashing the bytes of a large checkpoint at every start would be slow)."""
    where = Path(path).resolve()
    files = [where] if where.is_file() else sorted(p for p in where.iterdir() if p.is_file())
    return [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def salt(**what: object) -> bytes:
    """The seed of every key: a hash of `what` (model files, dtype, KV layout, TP rank and size)."""
    text = json.dumps({"format": FORMAT, **what}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def page_keys(path: Sequence[int], page_size: int, seed: bytes,
              adapter_seeds: dict[int, bytes] | None = None) -> list[bytes]:
    """The key of every whole page of `path` (prefix-cache tokens: their adapter's id and cache
    salt's namespace in each token's high bits), in order. An adapter's pages chain from its own
    seed (`adapter_seeds`: its id -> its files' hash; with none there for it, no keys: its pages
    are not stored); a salt's from a seed of its namespace, so that tenants share no page."""
    adapter, salt_ns, tokens = split_cache_key(path)
    if adapter:
        extra = (adapter_seeds or {}).get(adapter)
        if extra is None:
            return []
        seed = hashlib.sha256(seed + extra).digest()
    if salt_ns:
        salt_bytes = salt_ns.to_bytes(SALT_BITS // 8, "big")
        seed = hashlib.sha256(seed + b"cache_salt" + salt_bytes).digest()
    keys, prev = [], seed
    pack = struct.Struct(f"<{page_size}I").pack
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        prev = hashlib.sha256(prev + pack(*tokens[i : i + page_size])).digest()
        keys.append(prev)
    return keys
