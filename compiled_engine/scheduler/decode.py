"""Decode planning: one new token for every running request whose prompt is computed, a new page
where its last one is full, and retraction of the latest-admitted requests when the pool runs dry.
Under overlap a constrained request (structured output) skips a step while its previous token is in
flight: its token mask is computed from that token. Unconstrained requests never wait for it.

Speculative decoding (`speculation.py`): a request's decode may carry up to k draft tokens, proposed
from its known tokens, on pages nobody else's decode needs this step (drafts never retract anyone);
the drafts count against the step's token budget. Under overlap a request with a verify step in
flight waits for it (its lengths are known at its commit), and a drafting one waits for its token
in flight, unless its last proposal came back empty within `empty_retry` steps: it then decodes
plainly, so that a request with nothing to draft does not run every other step only. While a
verify step is in flight no decode retracts anyone (its rejected drafts' pages come back at its
commit)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.kv_book import KvBook
from compiled_engine.scheduler.plan import ReqStep, SlotWrite, TokenWrite
from compiled_engine.scheduler.request import Proposer, Request, Status


class DecodePlanner:
    """The running requests (in admission order: retraction takes the last) and their decodes."""

    def __init__(self, config: SchedulerConfig, book: KvBook,
                 requeue: Callable[[Request], None], propose: Proposer | None = None) -> None:
        """`requeue`: takes a retracted request (to the front of the waiting queue); `propose`:
        the draft tokens of a request's next step (with `config.speculative`)."""
        self.config, self.book, self._requeue = config, book, requeue
        self.propose = propose
        self.running: list[Request] = []
        self.num_retractions = 0

    def admit(self, reqs: list[Request]) -> None:
        self.running.extend(reqs)

    def drop(self, req: Request) -> None:
        self.running.remove(req)

    def plan(self, draft: StepDraft) -> None:
        """This step's decodes, into `draft` (retracting requests when the pool runs dry)."""
        ps = self.book.page_size
        spec = self.config.speculative
        speculating = spec is not None and self.propose is not None
        spare = self.config.chunk_budget - len(self.running)  # budget left for draft tokens
        committed = self.book.committed
        reserve = decode_page_reserve(self.running, ps)  # drafts leave them
        for req in list(self.running):
            c = req.planned_len
            d = req.device_len
            # retracted in this loop, still prefilling, or finishing at a pending commit
            if req.status is not Status.RUNNING or not _decodes(req):
                continue
            if c == len(req.pages) * ps:
                reserve -= 1
            in_flight = req.last_step > committed
            # its mask, or its lengths, need the step in flight: it waits (overlap only)
            if in_flight and (req.params.constrained or req.spec.verify_step > committed):
                continue
            drafting = (
                speculating
                and req.spec.paused_until < draft.step
                and req.spec.drafts_in_batch(spec, len(self.running))
            )
            if drafting and in_flight:
                if draft.step - req.spec.empty_at > spec.empty_retry:
                    continue  # its drafts continue the token in flight: it waits (overlap only)
                drafting = False  # nothing to draft lately: it decodes meanwhile
            pages = req.pages
            if c == len(pages) * ps:
                page = self._page_for(req)
                if page is None:
                    continue
                pages.append(page)
            drafts = self._drafts(req, draft.step, spare, reserve) if drafting and spare > 0 else ()
            spare -= len(drafts)
            n = 1 + len(drafts)
            slots = req.slots(ps, c, c + n)
            step = ReqStep(req.rid, req.row, c, n, slots, True, drafts)
            draft.add(req, step, SlotWrite(req.row, c, slots))
            if drafts:
                draft.token_writes.append(TokenWrite(req.row, c + 1, drafts))
                req.spec.verify_step = draft.step
            req.planned_len = c + n
            req.device_len = d + n

    def _drafts(self, req: Request, step: int, spare: int, reserve: int) -> tuple[int, ...]:
        """The draft tokens of `req`'s next step, as many as its limits, the budget and the free
        pages beyond `reserve` allow. Their pages are taken before the proposer runs (a draft model
        writes its own KV there) and those past the drafts it returns are given back at once (no
        step has seen them)."""
        book, ps = self.book, self.book.page_size
        spec = self.config.speculative
        assert spec is not None and self.propose is not None
        c, pages = req.planned_len, req.pages
        # every accepted draft and the bonus token must fit under max_len
        k = min(req.spec.draft_len(spec), req.max_len - req.device_len - 1, spare)
        need = -(-(c + 1 + k) // ps) - len(pages)
        if k > 0 and need > 0:
            new = book.alloc(need) if need <= book.available_pages() - reserve else None
            if new is None:  # drafts never retract anyone: as many as fit in the last page
                k = len(pages) * ps - c - 1
            else:
                pages.extend(new)
        drafts = ()
        if k > 0:
            drafts = tuple(self.propose(req, k))[:k]
            if not drafts:
                req.spec.empty_at = step
        keep = -(-(c + 1 + len(drafts)) // ps)
        if len(pages) > keep:
            book.allocator.free(pages[keep:])
            del pages[keep:]
        return drafts

    def _page_for(self, req: Request) -> int | None:
        """One new page for a decode, retracting latest-admitted requests when the pool is dry.

        None when `req` itself was retracted, or when pages come back once an in-flight step
        commits (deferred frees, requests that finish at that commit, the pages of rejected
        drafts): `req` then waits a step.
        """
        book = self.book
        while True:
            page = book.allocator.alloc_one()
            if page is not None:
                return page
            if book.cache.evict(1):
                continue
            if book.deferred or any(
                (r.planned_len >= r.fill_to and r.device_len == r.max_len)
                or r.spec.verify_step > book.committed  # its rejected drafts' pages come back
                for r in self.running
            ):
                return None
            victim = self.running[-1]
            deferred = victim.last_step > book.committed
            self._retract(victim)
            if victim is req or deferred:
                return None

    def _retract(self, req: Request) -> None:
        """Free a running request's KV; it waits to recompute prompt + generated tokens."""
        self.running.remove(req)
        self.book.release(req)
        req.status = Status.WAITING
        self._requeue(req)
        self.num_retractions += 1


def _decodes(req: Request) -> bool:
    """Whether a running request decodes (its prompt computed, room left)."""
    return req.planned_len >= req.fill_to and req.device_len < req.max_len


def decode_page_reserve(running: Iterable[Request], page_size: int) -> int:
    """Pages the running requests' next decodes need (those whose last page is full)."""
    return sum(1 for r in running if _decodes(r) and r.planned_len == len(r.pages) * page_size)
