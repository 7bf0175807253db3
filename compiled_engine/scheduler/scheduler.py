"""The scheduler: admission, chunked prefill, decode, retraction, abort, finish rules, commit.

Every decision depends only on the sequence of calls (add_request / abort / finish / schedule /
commit): lists and insertion-ordered dicts only, no set iteration, no clocks, no ids.

Overlap: ``schedule()`` for step k+1 may run before ``commit()`` of step k. A request planned in an
uncommitted step keeps its pages, row and lock until that step commits (deferred release), so nothing
an in-flight step touches is handed out again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from compiled_engine.scheduler.allocator import IdPool, PageAllocator
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.plan import Batch, ReqStep, SlotWrite, TokenEvent, TokenWrite
from compiled_engine.scheduler.prefix_cache import NaiveCache, PrefixCache
from compiled_engine.scheduler.radix_cache import RadixCache
from compiled_engine.scheduler.request import Request, Status
from compiled_engine.scheduler.sampling_params import SamplingParams

MAX_IN_FLIGHT = 2


SHARE_WAIT_TOKENS = 32  # a waiting request defers admission to reuse this many tokens of a running prefill


class RequestRejected(ValueError):
    """A request that can never run (bad parameters, empty prompt, too long for context or KV pool)."""


def check_ids(rid: str, prompt: tuple[int, ...] | list[int], stop_token_ids: list[int] | tuple[int, ...],
              seed: int | None, vocab_size: int) -> None:
    """Raise RequestRejected for token ids the model cannot embed and a seed torch cannot take."""
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(f"request {rid!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestRejected(f"request {rid!r}: stop_token_ids has {bad[0]}, outside the vocabulary")
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestRejected(f"request {rid!r}: seed must be in [0, 2**63), got {seed}")


def check_prompt(rid: str, prompt: tuple[int, ...] | list[int], max_context: int, capacity_tokens: int) -> None:
    """Raise RequestRejected for a prompt that can never run: empty, negative ids, no room for one
    generated token in the context or in the whole KV pool."""
    n = len(prompt)
    if n == 0:
        raise RequestRejected(f"request {rid!r}: the prompt is empty (at least one token is needed)")
    if min(prompt) < 0:
        raise RequestRejected(f"request {rid!r}: negative token id {min(prompt)} in the prompt")
    if n >= max_context:
        raise RequestRejected(
            f"request {rid!r}: the prompt has {n} tokens but the context limit is {max_context} "
            f"(the prompt must be shorter to leave room for a generated token)"
        )
    if n + 1 > capacity_tokens:
        raise RequestRejected(
            f"request {rid!r}: the prompt has {n} tokens and needs {n + 1} KV slots with one generated "
            f"token, but the whole KV pool holds {capacity_tokens}"
        )


@dataclass(slots=True)
class _Deferred:
    """Resources of a released request, returned once step ``barrier`` commits."""

    barrier: int
    lock: object | None
    pages: list[int]
    row: int


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_free_pages: int
    num_cached_pages: int  # pages held by the prefix cache
    kv_usage: float  # fraction of usable pages not on the free list
    cache_hit_rate: float  # prefix tokens reused / prompt tokens looked up at admission
    num_retractions: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.rows = IdPool(config.max_rows)
        self.cache: PrefixCache = (
            RadixCache(self.allocator) if config.prefix_cache == "radix" else NaiveCache(config.page_size)
        )
        self._eos = frozenset(config.eos_token_ids)
        self._reqs: dict[str, Request] = {}  # live requests (waiting or running)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order (retraction takes the last)
        self._inflight: deque[tuple[Batch, tuple[Request, ...]]] = deque()
        self._deferred: list[_Deferred] = []
        self._rewrites: list[Request] = []
        self._next_step = 0
        self._committed = -1  # id of the last committed step
        self.num_retractions = 0

    # -- inputs ----------------------------------------------------------------------------------

    def add_request(
        self, rid: str, prompt_token_ids: list[int] | tuple[int, ...], sampling_params: SamplingParams | None = None
    ) -> None:
        sp = sampling_params if sampling_params is not None else SamplingParams()
        try:
            sp.validate()
        except ValueError as e:
            raise RequestRejected(f"request {rid!r}: {e}") from None
        prompt = tuple(prompt_token_ids)
        n = len(prompt)
        cfg = self.config
        check_prompt(rid, prompt, cfg.max_context, cfg.capacity_tokens)
        if rid in self._reqs:
            raise RequestRejected(f"request {rid!r}: a live request already has this id")
        stop_ids = frozenset(sp.stop_token_ids) if sp.ignore_eos else self._eos | frozenset(sp.stop_token_ids)
        max_len = min(n + sp.max_tokens, cfg.max_context, cfg.capacity_tokens + 1)
        req = Request(rid, prompt, sp, max_len, stop_ids, device_len=n)
        self._reqs[rid] = req
        self._waiting.append(req)

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; unknown or already finished ids are ignored."""
        req = self._reqs.get(rid)
        if req is not None:
            self._end(req, Status.ABORTED, "abort")

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request from outside (the detokenizer matched a stop string). No event is emitted."""
        req = self._reqs.get(rid)
        if req is not None:
            self._end(req, Status.FINISHED, reason)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._inflight)

    # -- planning --------------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """Plan the next step, or None when nothing can run now (commit in-flight steps first)."""
        if len(self._inflight) >= MAX_IN_FLIGHT:
            raise RuntimeError(f"at most {MAX_IN_FLIGHT} steps may be in flight: commit one first")
        step = self._next_step
        reqs: list[ReqStep] = []
        members: list[Request] = []
        slot_writes: list[SlotWrite] = []
        token_writes: list[TokenWrite] = []
        budget = self.config.chunk_budget
        if self.config.mixed:
            self._plan_decodes(step, reqs, members, slot_writes)
            self._plan_prefills(step, budget - len(reqs), reqs, members, slot_writes, token_writes)
        else:
            self._plan_prefills(step, budget, reqs, members, slot_writes, token_writes)
            if not reqs:
                self._plan_decodes(step, reqs, members, slot_writes)
        if not reqs:
            return None
        self._next_step += 1
        batch = Batch(
            step=step,
            reqs=tuple(reqs),
            slot_writes=tuple(self._take_rewrites() + slot_writes),
            token_writes=tuple(token_writes),
            is_decode=all(r.length == 1 for r in reqs),
        )
        self._inflight.append((batch, tuple(members)))
        return batch

    def _plan_decodes(
        self, step: int, reqs: list[ReqStep], members: list[Request], slot_writes: list[SlotWrite]
    ) -> None:
        ps = self.page_size
        for req in list(self._running):
            c = req.cached_len
            d = req.device_len
            if req.status is not Status.RUNNING or c < req.fill_to or d >= req.max_len:
                continue  # retracted in this loop, still prefilling, or finishing at a pending commit
            pages = req.pages
            if c == len(pages) * ps:
                page = self._page_for(req)
                if page is None:
                    continue
                pages.append(page)
            slot = pages[c // ps] * ps + c % ps
            slots = (slot,)
            reqs.append(ReqStep(req.rid, req.row, c, 1, slots, True, req.sampling))
            slot_writes.append(SlotWrite(req.row, c, slots))
            members.append(req)
            req.cached_len = c + 1
            req.device_len = d + 1
            req.last_step = step

    def _page_for(self, req: Request) -> int | None:
        """One new page for a decode, retracting latest-admitted requests when the pool is dry.

        None when ``req`` itself was retracted, or when pages come back once an in-flight step
        commits (deferred frees, requests that finish at that commit): ``req`` then waits a step.
        """
        while True:
            page = self.allocator.alloc_one()
            if page is not None:
                return page
            if self.cache.evict(1):
                continue
            if self._deferred or any(r.cached_len >= r.fill_to and r.device_len == r.max_len for r in self._running):
                return None
            victim = self._running[-1]
            deferred = victim.last_step > self._committed
            self._retract(victim)
            if victim is req or deferred:
                return None

    def _plan_prefills(
        self,
        step: int,
        budget: int,
        reqs: list[ReqStep],
        members: list[Request],
        slot_writes: list[SlotWrite],
        token_writes: list[TokenWrite],
    ) -> None:
        chunked = [r for r in self._running if r.cached_len < r.fill_to]
        if not chunked and not self._waiting:
            return
        # Optimistic admission, one step ahead only: leave the pages running decodes need next step.
        ps = self.page_size
        reserve = sum(
            1
            for r in self._running
            if r.cached_len >= r.fill_to and r.device_len < r.max_len and r.cached_len == len(r.pages) * ps
        )
        # A chunked request continues first, then the waiting queue in order (no overtaking).
        for req in chunked:
            if budget <= 0:
                return
            if not self._plan_chunk(req, step, budget, req.cached_len, reqs, members, slot_writes, reserve):
                return
            budget -= reqs[-1].length
        cfg = self.config
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < cfg.max_running and self.rows.num_free:
            req = waiting[0]
            if req.last_step > self._committed:
                return  # retracted with a token still in flight: its tokens are not all known yet
            tokens = req.tokens()
            handle, hit = self.cache.match(tokens[:-1])
            if self._shares_pending_prefix(tokens, len(hit) * ps):
                return  # wait a step: a running prefill is about to cache what this request would recompute
            self.cache.lock(handle)
            req.lock = handle
            req.pages = list(hit)
            req.prefix_pages = len(hit)
            req.cached_len = len(hit) * self.page_size
            req.fill_to = len(tokens)
            row = self.rows.alloc_one()
            assert row is not None
            req.row = row
            if not self._plan_chunk(req, step, budget, 0, reqs, members, slot_writes, reserve):
                self.cache.unlock(handle)
                self.rows.free([row])
                req.lock, req.pages, req.prefix_pages, req.cached_len, req.row = None, [], 0, 0, -1
                return
            self.cache.record(len(tokens), len(hit) * self.page_size)
            waiting.popleft()
            req.status = Status.RUNNING
            self._running.append(req)
            token_writes.append(TokenWrite(row, 0, tokens))
            budget -= reqs[-1].length

    def _shares_pending_prefix(self, tokens: tuple[int, ...], hit_len: int) -> bool:
        """True when a running request's prompt, not yet in the radix cache, shares at least
        `SHARE_WAIT_TOKENS` (and a page) more tokens with `tokens` than the cache already gives.

        Requests arriving together with a new common prefix would otherwise each prefill it in full; the
        later ones wait until the first one's chunk commits and then hit the cache. A prompt's uncached
        tail is shorter than a page once it is fully inserted, so the wait always ends."""
        if not isinstance(self.cache, RadixCache):
            return False
        need = max(SHARE_WAIT_TOKENS, self.page_size)
        limit = len(tokens) - 1
        if limit - hit_len < need:
            return False
        for r in self._running:
            if r.prefix_pages * self.page_size + need > r.fill_to:
                continue  # its prompt is (as good as) cached already
            other = r.tokens()
            n = min(limit, r.fill_to)
            if n - hit_len < need or other[hit_len : hit_len + need] != tokens[hit_len : hit_len + need]:
                continue
            return True
        return False

    def _plan_chunk(
        self,
        req: Request,
        step: int,
        budget: int,
        write_from: int,
        reqs: list[ReqStep],
        members: list[Request],
        slot_writes: list[SlotWrite],
        reserve: int = 0,
    ) -> bool:
        """Plan the next prefill chunk of ``req``; page-table writes cover ``write_from`` onwards.

        False (nothing changed) when the chunk's pages are not available beyond ``reserve`` pages.
        """
        ps = self.page_size
        start = req.cached_len
        n = min(req.fill_to - start, budget)
        end = start + n
        need = -(-end // ps) - len(req.pages)
        if need > 0:
            if need + reserve > self.allocator.num_free + self.cache.evictable_pages:
                return False
            new = self._alloc(need)
            if new is None:
                return False
            req.pages.extend(new)
        sample = end == req.fill_to and req.device_len < req.max_len
        out = self._slots(req, start, end)
        reqs.append(ReqStep(req.rid, req.row, start, n, out, sample, req.sampling))
        slot_writes.append(SlotWrite(req.row, write_from, self._slots(req, write_from, start) + out))
        members.append(req)
        req.cached_len = end
        if sample:
            req.device_len += 1
        req.last_step = step
        return True

    def _slots(self, req: Request, lo: int, hi: int) -> tuple[int, ...]:
        ps = self.page_size
        pages = req.pages
        if ps == 1:
            return tuple(pages[lo:hi])
        return tuple(pages[p // ps] * ps + p % ps for p in range(lo, hi))

    def _alloc(self, n: int) -> list[int] | None:
        pages = self.allocator.alloc(n)
        if pages is None:
            self.cache.evict(n - self.allocator.num_free)
            pages = self.allocator.alloc(n)
        return pages

    def _retract(self, req: Request) -> None:
        """Free a running request's KV and queue it first to recompute prompt + generated tokens."""
        self._running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        self._waiting.appendleft(req)
        self.num_retractions += 1

    def _take_rewrites(self) -> list[SlotWrite]:
        out = []
        for req in self._rewrites:
            if req.status is Status.RUNNING and req.rewrite is not None:
                lo, hi = req.rewrite
                out.append(SlotWrite(req.row, lo, self._slots(req, lo, hi)))
            req.rewrite = None
        self._rewrites.clear()
        return out

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, batch: Batch, sampled_tokens: list[int]) -> list[TokenEvent]:
        """Apply the sampled tokens of the oldest in-flight step (one per sampling ReqStep, in order)."""
        if not self._inflight or self._inflight[0][0] is not batch:
            raise ValueError(f"commit of step {batch.step} out of order: steps are committed as planned")
        _, members = self._inflight.popleft()
        self._committed = batch.step
        tokens = iter(sampled_tokens)
        events: list[TokenEvent] = []
        for rs, req in zip(batch.reqs, members, strict=True):
            status = req.status
            if rs.sample:
                tok = next(tokens)
                if status is Status.FINISHED or status is Status.ABORTED:
                    continue  # planned before the request ended: the token is discarded
                req.output.append(tok)
                reason = self._finish_reason(req, tok)
                events.append(TokenEvent(req.rid, tok, reason is not None, reason))
                if reason is not None:
                    self._end(req, Status.FINISHED, reason)
                elif status is Status.RUNNING and rs.start < req.fill_to:
                    self._cache_prefix(req, rs.start + rs.length)
            elif status is Status.RUNNING:
                if req.device_len == req.max_len and req.cached_len == req.device_len:
                    events.append(TokenEvent(req.rid, None, True, "length"))  # max_tokens == 0
                    self._end(req, Status.FINISHED, "length")
                else:
                    self._cache_prefix(req, rs.start + rs.length)
        if next(tokens, None) is not None:
            raise ValueError(f"step {batch.step}: more sampled tokens than sampling requests")
        if self._deferred and self._deferred[0].barrier <= batch.step:
            keep = []
            for d in self._deferred:
                if d.barrier <= batch.step:
                    self._apply_release(d)
                else:
                    keep.append(d)
            self._deferred = keep
        return events

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        n_out = len(req.output)
        if tok in req.stop_ids and n_out > req.sampling.min_tokens:
            return "stop"
        if len(req.prompt) + n_out >= req.max_len:
            return "length"
        return None

    # -- release ---------------------------------------------------------------------------------

    def _end(self, req: Request, status: Status, reason: str) -> None:
        was = req.status
        req.status = status
        req.finish_reason = reason
        del self._reqs[req.rid]
        if was is Status.RUNNING:
            self._running.remove(req)
            self._release(req)
        else:
            self._waiting.remove(req)  # holds nothing (new, or retracted and already released)

    def _release(self, req: Request) -> None:
        """Cache the computed prefix, then return pages, row and lock (deferred while in flight)."""
        dups = self._cache_prefix(req, min(req.cached_len, req.known_len), live=False)
        d = _Deferred(req.last_step, req.lock, req.pages[req.prefix_pages :] + dups, req.row)
        req.pages, req.lock, req.prefix_pages, req.row, req.cached_len, req.rewrite = [], None, 0, -1, 0, None
        if d.barrier > self._committed:
            self._deferred.append(d)
        else:
            self._apply_release(d)

    def _apply_release(self, d: _Deferred) -> None:
        if d.lock is not None:
            self.cache.unlock(d.lock)
        self.allocator.free(d.pages)
        if d.row >= 0:
            self.rows.free([d.row])

    def _cache_prefix(self, req: Request, upto: int, live: bool = True) -> list[int]:
        """Insert the first ``upto`` computed positions into the prefix cache and lock that prefix.

        Pages the cache already held for these tokens (another request inserted the same prefix first)
        replace the request's duplicates in its row; the duplicates are returned when ``live`` is
        False, otherwise freed once the request's in-flight steps commit and the row is rewritten.
        """
        n_pages = upto // self.page_size
        if n_pages <= req.prefix_pages:
            return []
        ps = self.page_size
        handle, cached = self.cache.insert(req.tokens()[: n_pages * ps], req.pages[:n_pages])
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
        if not dups or not live:
            return dups
        lo, hi = first * ps, m * ps
        if req.rewrite is None:
            self._rewrites.append(req)
        else:
            lo, hi = min(lo, req.rewrite[0]), max(hi, req.rewrite[1])
        req.rewrite = (lo, hi)
        d = _Deferred(req.last_step, None, dups, -1)
        if d.barrier > self._committed:
            self._deferred.append(d)
        else:
            self._apply_release(d)
        return []

    # -- inspection ------------------------------------------------------------------------------

    def get_request(self, rid: str) -> Request | None:
        return self._reqs.get(rid)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> SchedulerStats:
        total = self.allocator.total
        free = self.allocator.num_free
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_free_pages=free,
            num_cached_pages=len(self.cache.cached_pages()),
            kv_usage=(total - free) / total,
            cache_hit_rate=self.cache.hit_rate,
            num_retractions=self.num_retractions,
        )

    def check_integrity(self) -> None:
        """Assert every ledger invariant (DESIGN.md, "The ledger"); AssertionError names the breach."""
        ps = self.page_size
        self.allocator.check()
        self.rows.check()
        where: dict[int, str] = {}

        def claim(pages: list[int] | tuple[int, ...], place: str) -> None:
            for p in pages:
                assert 1 <= p < self.config.num_pages, f"page {p} ({place}) is outside the pool"
                assert p not in where, f"page {p} is both in {where[p]} and in {place}"
                where[p] = place

        claim(self.allocator.free_ids(), "the free list")
        claim(self.cache.cached_pages(), "the prefix cache")
        rows: dict[int, str] = {r: "the free rows" for r in self.rows.free_ids()}

        def claim_row(r: int, place: str) -> None:
            assert 0 <= r < self.config.max_rows, f"row {r} ({place}) is outside the table"
            assert r not in rows, f"row {r} is both in {rows[r]} and in {place}"
            rows[r] = place

        assert len(self._running) <= self.config.max_running, "more running requests than max_running"
        for req in self._running:
            name = f"request {req.rid!r}"
            assert req.status is Status.RUNNING and self._reqs.get(req.rid) is req, f"{name}: not live running"
            assert req.lock is not None, f"{name} runs without a prefix-cache lock"
            assert req.row >= 0, f"{name} runs without a table row"
            claim_row(req.row, name)
            assert 0 <= req.cached_len <= req.device_len <= req.max_len, (
                f"{name}: lengths cached {req.cached_len} device {req.device_len} max {req.max_len}"
            )
            assert req.cached_len < req.device_len or req.device_len == req.max_len, (
                f"{name}: nothing left to compute but not at its maximum length"
            )
            assert len(req.pages) == -(-req.cached_len // ps), (
                f"{name}: {len(req.pages)} pages for {req.cached_len} computed positions"
            )
            shared = tuple(req.pages[: req.prefix_pages])
            assert shared == self.cache.pages_of(req.lock), f"{name}: row prefix differs from its cached path"
            for p in shared:
                assert where.get(p) == "the prefix cache", f"{name}: row points at page {p} not in the cache"
            claim(req.pages[req.prefix_pages :], name)
        for req in self._waiting:
            name = f"waiting request {req.rid!r}"
            assert req.status is Status.WAITING and self._reqs.get(req.rid) is req, f"{name}: not live waiting"
            assert not req.pages and req.lock is None and req.row < 0, f"{name} holds resources"
        assert len(self._reqs) == len(self._running) + len(self._waiting), "live map out of sync with queues"
        for d in self._deferred:
            assert d.barrier > self._committed, f"deferred release past its step {d.barrier}"
            claim(d.pages, f"deferred free (step {d.barrier})")
            if d.row >= 0:
                claim_row(d.row, f"deferred row (step {d.barrier})")
        missing = [p for p in range(1, self.config.num_pages) if p not in where]
        assert not missing, f"pages {missing[:8]} are nowhere (leaked)"
        assert len(rows) == self.config.max_rows, "a table row is leaked"
        held = [r.lock for r in self._running] + [d.lock for d in self._deferred if d.lock is not None]
        self.cache.check(held)
        if not self._running and not self._inflight:
            assert not self._deferred, "deferred frees with no step in flight"
            cached = len(self.cache.cached_pages())
            assert self.allocator.num_free + cached == self.allocator.total, (
                f"idle: free {self.allocator.num_free} + cached {cached} != total {self.allocator.total}"
            )
