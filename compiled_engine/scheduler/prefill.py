"""Prefill planning under the step's token budget: chunked requests continue first, then the waiting
queue is admitted in order (no overtaking) while the budget, the table rows and the pages last."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain

from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.decode import decode_page_reserve
from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.kv_book import KvBook
from compiled_engine.scheduler.plan import ReqStep, SlotWrite, TierLoad, TokenWrite
from compiled_engine.scheduler.priority import rank
from compiled_engine.scheduler.radix_cache import RadixCache
from compiled_engine.scheduler.request import Request, Status


class PrefillPlanner:
    """The waiting queue (new requests at the back, retracted ones at the front) and the prefill
    chunks of each step."""

    def __init__(self, config: SchedulerConfig, book: KvBook) -> None:
        self.config, self.book = config, book
        self.waiting: deque[Request] = deque()
        # steps a waiting request deferred admission to share a running prefill
        self.num_prefix_waits = 0

    def order_by_rank(self, step: int) -> None:
        """Priority scheduling: the waiting queue in rank order (`priority.rank`)."""
        aging = self.config.aging_steps
        self.waiting = deque(sorted(self.waiting, key=lambda r: rank(r, step, aging)))

    def blocked(self, req: Request, running: Sequence[Request], coming: int = 0) -> bool:
        """Whether waiting request `req` cannot be admitted now for want of a row, a running place
        or the pages of its first chunk (beyond what running decodes need next; `coming`: pages
        on their way back, counted as free). An adapter slot it waits for is not counted: a
        preemption would not free one for it."""
        book = self.book
        if len(running) >= self.config.max_running or not book.rows.num_free:
            return True
        ps, cfg = book.page_size, self.config
        tokens = req.cache_tokens()
        whole = req.params.every_position and not req.output  # admitted without a cache hit
        hit = 0 if whole else book.cache.peek(tokens[:-1])
        budget = max(1, cfg.chunk_budget - (len(running) if cfg.mixed else 0))  # decodes first
        end = min(len(tokens), hit * ps + budget)
        need = -(-end // ps) - hit
        return need + decode_page_reserve(running, ps) > book.available_pages() + coming

    def requeue(self, retracted: Request) -> None:
        """A retracted request goes first (the latest retracted at the front)."""
        self.waiting.appendleft(retracted)

    def plan(self, draft: StepDraft, budget: int, running: list[Request]) -> list[Request]:
        """This step's prefill chunks, into `draft`: those of `running` requests still prefilling,
        then the waiting queue's in order; returns the requests admitted (running from now on)."""
        book, waiting = self.book, self.waiting
        admitted: list[Request] = []
        chunked = [r for r in running if r.planned_len < r.fill_to]
        if not chunked and not waiting:
            return admitted
        # Optimistic admission, one step ahead only: leave the pages running decodes need next step.
        ps = book.page_size
        reserve = decode_page_reserve(running, ps)
        for req in chunked:
            if budget <= 0:
                return admitted
            if not plan_chunk(book, req, draft, budget, req.planned_len, reserve):
                return admitted
            budget -= draft.reqs[-1].length
        while (
            waiting
            and budget > 0
            and len(running) + len(admitted) < self.config.max_running
            and book.rows.num_free
        ):
            req = waiting[0]
            if req.last_step > book.committed:
                return admitted  # retracted with a token in flight: its tokens are not all known
            tokens = req.cache_tokens()
            whole = req.params.every_position and not req.output
            slot = -1
            if req.params.adapter:
                slot = book.adapters.acquire(req.params.adapter, book.committed)
                if slot is None:
                    return admitted  # every adapter slot is in use: it waits for one
            handle, hit = book.cache.match(() if whole else tokens[:-1])
            if not whole and self._shares_pending_prefix(chain(running, admitted), tokens,
                                                         len(hit) * ps):
                self.num_prefix_waits += 1
                if slot >= 0:
                    book.adapters.release(slot, -1)
                # wait a step: a running prefill is about to cache what this request would recompute
                return admitted
            book.cache.lock(handle)
            row = book.rows.alloc_one()
            assert row is not None
            req.lock, req.pages, req.prefix_pages, req.planned_len = (
                handle,
                list(hit),
                len(hit),
                len(hit) * ps,
            )
            req.fill_to = len(tokens)
            req.row, req.adapter_slot = row, slot
            load = TierLoad(req.rid, 0, ()) if whole else _load_host_pages(book, req, reserve)
            if load is None or not plan_chunk(book, req, draft, budget, 0, reserve):
                book.cache.unlock(handle)
                book.rows.free([row])
                if slot >= 0:
                    book.adapters.release(slot, -1)
                if load is not None:
                    book.allocator.free(list(load.pages))  # no step has seen them
                req.lock, req.pages, req.prefix_pages, req.planned_len, req.row = None, [], 0, 0, -1
                req.adapter_slot = -1
                return admitted
            book.cache.record(len(tokens), len(hit) * ps)
            if req.cached_tokens < 0:
                req.cached_tokens = (len(hit) + len(load.pages)) * ps
            if load.pages:
                req.host_loaded = True  # a retracted request recomputes them (or hits the cache)
                draft.tier_loads.append(load)
                book.tier_hit_tokens += len(load.pages) * ps
            waiting.popleft()
            req.status = Status.RUNNING
            admitted.append(req)
            draft.token_writes.append(TokenWrite(row, 0, req.tokens()))
            budget -= draft.reqs[-1].length
        return admitted

    def _shares_pending_prefix(self, running: Iterable[Request], tokens: tuple[int, ...],
                               hit_len: int) -> bool:
        """True when a running request's prompt, not yet in the radix cache, shares at least
        `config.share_wait_tokens` (and a page) more tokens with `tokens` than the cache already
        gives.

        Requests arriving together with a new common prefix would otherwise each prefill it in
        full; the later ones wait until the first one's chunk commits and then hit the cache. A
        prompt's uncached tail is shorter than a page once it is fully inserted, so the wait always
        ends."""
        book = self.book
        if not isinstance(book.cache, RadixCache):
            return False
        ps = book.page_size
        need = max(self.config.share_wait_tokens, ps)
        limit = len(tokens) - 1
        if limit - hit_len < need:
            return False
        for r in running:
            if r.prefix_pages * ps + need > r.fill_to:
                continue  # its prompt is (as good as) cached already
            n = min(limit, r.fill_to)
            if (
                n - hit_len < need
                or r.cache_tokens()[hit_len : hit_len + need] != tokens[hit_len : hit_len + need]
            ):
                continue
            return True
        return False


def _load_host_pages(book: KvBook, req: Request, reserve: int) -> TierLoad | None:
    """Pages for the prompt pages the engine holds on the host past the cache's hit (the load is
    empty when there are none, the hit does not reach them, or they were loaded once already: the
    engine keeps them until then only); None when the pages are not available beyond `reserve`
    (nothing changed)."""
    first, end = req.params.host_pages
    have = len(req.pages)
    end = min(end, (req.fill_to - 1) // book.page_size)  # at least one position is computed
    if req.host_loaded or not first <= have < end:
        return TierLoad(req.rid, have, ())
    if end - have + reserve > book.available_pages():
        return None
    pages = book.alloc(end - have)
    if pages is None:
        return None
    req.pages.extend(pages)
    req.planned_len = end * book.page_size
    return TierLoad(req.rid, have, tuple(pages))


def plan_chunk(
    book: KvBook, req: Request, draft: StepDraft, budget: int, write_from: int, reserve: int = 0
) -> bool:
    """Plan the next prefill chunk of `req`; page-table writes cover `write_from` onwards.

    False (nothing changed) when the chunk's pages are not available beyond `reserve` pages.
    """
    ps = book.page_size
    start = req.planned_len
    n = min(req.fill_to - start, budget)
    end = start + n
    need = -(-end // ps) - len(req.pages)
    if need > 0:
        if need + reserve > book.available_pages():
            return False
        new = book.alloc(need)
        if new is None:
            return False
        req.pages.extend(new)
    sample = end == req.fill_to and req.device_len < req.max_len
    out = req.slots(ps, start, end)
    step = ReqStep(req.rid, req.row, start, n, out, sample, lora_slot=req.adapter_slot)
    draft.add(req, step, SlotWrite(req.row, write_from, req.slots(ps, write_from, start) + out))
    req.planned_len = end
    book.prefill_tokens += n
    if sample:
        req.device_len += 1
    return True
