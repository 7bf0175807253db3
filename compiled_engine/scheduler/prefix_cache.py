"""The prefix-cache interface and the naive cache (no reuse).

A cache maps page-aligned token prefixes to the KV pages that hold them. A *handle* names a cached
prefix; a request locks the handle of the prefix it reads so that it is never evicted under it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheStored:
    """Pages now cached: the KV of `path[start:]`, which follows the cached `path[:start]`, in
    `pages`."""

    path: tuple[int, ...]
    start: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheRemoved:
    """Pages no longer cached: those of `path[start:]` (nothing cached extends them)."""

    path: tuple[int, ...]
    start: int


class PrefixCache(ABC):
    page_size: int
    root: object  # handle of the empty prefix; locking it protects nothing
    hit_tokens: int
    queried_tokens: int
    num_evicted_pages: int  # pages evicted so far
    # What was stored and removed since the reader last took the list (None: not recorded). The
    # engine turns them into KV events for routers (compiled_engine/kv_events).
    events: list[CacheStored | CacheRemoved] | None = None

    @abstractmethod
    def match(self, tokens: Sequence[int]) -> tuple[object, tuple[int, ...]]:
        """Longest cached page-aligned prefix of ``tokens``: its handle and its pages."""

    def peek(self, tokens: Sequence[int]) -> int:
        """How many pages of ``tokens`` `match` would find now (changes nothing)."""
        return 0

    @abstractmethod
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[object, tuple[int, ...]]:
        """Offer ``pages`` (one per ``page_size`` tokens) holding the KV of ``tokens``.

        Returns the handle and pages of the longest prefix now cached. Where a returned page differs
        from the offered one the offered page is a duplicate: the caller still owns it (frees it)
        and must point its page-table row at the cached page. Offered pages past the returned ones
        also stay with the caller.
        """

    @abstractmethod
    def lock(self, handle: object) -> None: ...

    @abstractmethod
    def unlock(self, handle: object) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` unlocked pages into the allocator if possible; returns pages
        freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_cached_pages(self) -> int:
        """Pages the cache owns, counted as they come and go (O(1))."""

    @abstractmethod
    def pages_of(self, handle: object) -> tuple[int, ...]:
        """The pages of the whole prefix named by ``handle``."""

    @abstractmethod
    def cached_pages(self) -> list[int]:
        """Every page the cache owns (for integrity checks and accounting)."""

    @abstractmethod
    def check(self, held: Sequence[object]) -> None:
        """Assert the cache's invariants; ``held`` lists every live lock (with multiplicity)."""

    def record(self, queried: int, hit: int) -> None:
        """Count one admission's prefix lookup (``hit`` of ``queried`` tokens reused)."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class NaiveCache(PrefixCache):
    """Caches nothing: every request computes its whole prompt and frees its pages at the end."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = object()
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.num_evicted_pages = 0

    def match(self, tokens: Sequence[int]) -> tuple[object, tuple[int, ...]]:
        return self.root, ()

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[object, tuple[int, ...]]:
        return self.root, ()

    def lock(self, handle: object) -> None:
        assert handle is self.root, "naive cache: foreign handle"

    def unlock(self, handle: object) -> None:
        assert handle is self.root, "naive cache: foreign handle"

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def num_cached_pages(self) -> int:
        return 0

    def pages_of(self, handle: object) -> tuple[int, ...]:
        return ()

    def cached_pages(self) -> list[int]:
        return []

    def check(self, held: Sequence[object]) -> None:
        assert all(h is self.root for h in held), "naive cache: a lock on a foreign handle"
