"""The KV resources the running requests hold: pages, table rows and prefix-cache locks; their
release, deferred while a step that may touch them is in flight; and the caching of computed
prefixes.

Overlap: a request planned in an uncommitted step keeps its pages, row and lock until that step
commits, so nothing an in-flight step touches is handed out again.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.scheduler.adapter_slots import AdapterSlots
from compiled_engine.scheduler.allocator import IdPool, PageAllocator
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.plan import SlotWrite
from compiled_engine.scheduler.prefix_cache import NaiveCache, PrefixCache
from compiled_engine.scheduler.radix_cache import RadixCache
from compiled_engine.scheduler.request import Request, Status


@dataclass(slots=True)
class DeferredRelease:
    """Resources of a released request (or a request's duplicate pages), returned once step
    `barrier` commits."""

    barrier: int
    lock: object | None
    pages: list[int]
    row: int


class KvBook:
    def __init__(self, config: SchedulerConfig) -> None:
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.rows = IdPool(config.max_rows)
        self.adapters = AdapterSlots(config.max_loras)
        self.cache: PrefixCache = (
            RadixCache(self.allocator)
            if config.prefix_cache == "radix"
            else NaiveCache(config.page_size)
        )
        self.deferred: list[DeferredRelease] = []
        self.committed = -1  # id of the last committed step
        self.num_dedup_pages = 0  # private pages replaced by the cache's copies of the same tokens
        self.tier_hit_tokens = 0  # prompt tokens loaded from the host (the KV tier), not computed
        self.prefill_tokens = 0  # positions computed by prefill chunks (recomputation included)
        self._rewrites: list[Request] = []

    # -- pages -----------------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, evicting cached ones if the free list is short; None when even that cannot."""
        pages = self.allocator.alloc(n)
        if pages is None:
            self.cache.evict(n - self.allocator.num_free)
            pages = self.allocator.alloc(n)
        return pages

    def available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_pages

    # -- release ---------------------------------------------------------------------------------

    def release(self, req: Request) -> None:
        """Cache the computed prefix, then return pages, row and lock (deferred while in flight)."""
        dups = self.cache_prefix(req, min(req.planned_len, req.known_len), live=False)
        if req.adapter_slot >= 0:
            self.adapters.release(req.adapter_slot, req.last_step)
            req.adapter_slot = -1
        d = DeferredRelease(req.last_step, req.lock, req.pages[req.prefix_pages :] + dups, req.row)
        req.pages, req.lock, req.prefix_pages, req.row, req.planned_len, req.rewrite = (
            [],
            None,
            0,
            -1,
            0,
            None,
        )
        self._defer(d)

    def commit_step(self, step: int) -> None:
        """Step `step` committed: return what waited for it."""
        self.committed = step
        if self.deferred and self.deferred[0].barrier <= step:
            keep = []
            for d in self.deferred:
                if d.barrier <= step:
                    self._apply(d)
                else:
                    keep.append(d)
            self.deferred = keep

    def _defer(self, d: DeferredRelease) -> None:
        if d.barrier > self.committed:
            self.deferred.append(d)
        else:
            self._apply(d)

    def _apply(self, d: DeferredRelease) -> None:
        if d.lock is not None:
            self.cache.unlock(d.lock)
        self.allocator.free(d.pages)
        if d.row >= 0:
            self.rows.free([d.row])

    def truncate(self, req: Request, planned_len: int) -> None:
        """Forget `req`'s positions from `planned_len` on (rejected drafts): pages past the last one
        still used go back (their step has committed; nothing else references them)."""
        keep = -(-planned_len // self.page_size)
        extra = req.pages[keep:]
        del req.pages[keep:]
        req.planned_len = planned_len
        if extra:
            self._defer(DeferredRelease(req.last_step, None, extra, -1))

    # -- caching ---------------------------------------------------------------------------------

    def cache_prefix(self, req: Request, upto: int, live: bool = True) -> list[int]:
        """Insert the first `upto` computed positions into the prefix cache and lock that prefix.

        Pages the cache already held for these tokens (another request inserted the same prefix
        first) replace the request's duplicates in its row; the duplicates are returned when `live`
        is False, otherwise freed once the request's in-flight steps commit and the row is
        rewritten.
        """
        ps = self.page_size
        n_pages = upto // ps
        if n_pages <= req.prefix_pages:
            return []
        handle, cached = self.cache.insert(req.cache_tokens()[: n_pages * ps],
                                           req.pages[:n_pages])
        m = len(cached)
        if m <= req.prefix_pages:
            return []  # naive cache: nothing is cached, the pages stay private
        dups: list[int] = []
        pages = req.pages
        first = -1
        for i in range(req.prefix_pages, m):
            if pages[i] != cached[i]:
                dups.append(pages[i])
                pages[i] = cached[i]
                if first < 0:
                    first = i
        self.cache.lock(handle)
        self.cache.unlock(req.lock)
        req.lock = handle
        req.prefix_pages = m
        self.num_dedup_pages += len(dups)
        if not dups or not live:
            return dups
        lo, hi = first * ps, m * ps
        if req.rewrite is None:
            self._rewrites.append(req)
        else:
            lo, hi = min(lo, req.rewrite[0]), max(hi, req.rewrite[1])
        req.rewrite = (lo, hi)
        self._defer(DeferredRelease(req.last_step, None, dups, -1))
        return []

    def take_rewrites(self) -> list[SlotWrite]:
        """Page-table writes that point rows at the cached copies of their duplicate pages."""
        out = []
        for req in self._rewrites:
            if req.status is Status.RUNNING and req.rewrite is not None:
                lo, hi = req.rewrite
                out.append(SlotWrite(req.row, lo, req.slots(self.page_size, lo, hi)))
            req.rewrite = None
        self._rewrites.clear()
        return out
