"""Decode planning: one new token for every running request whose prompt is computed, a new page
where its last one is full, and retraction of the latest-admitted requests when the pool runs dry.
Under overlap a constrained request (structured output) skips a step while its previous token is in
flight: its token mask is computed from that token. Unconstrained requests never wait for it.

Speculative decoding (`speculation.py`): a request's decode may carry up to k draft tokens. The plan
asks for them (`StepPlan.draft_asks`) with their pages taken, on pages nobody else's decode needs
this step (drafts never retract anyone); the engine proposes them from the request's known tokens
and `add_drafts` puts them in the plan. The drafts asked count against the step's token budget.
Under overlap a request with a verify step in flight waits for it (its lengths are known at its
commit), and a drafting one waits for its token in flight, unless its last proposal came back empty
within `empty_retry` steps: it then decodes plainly, so that a request with nothing to draft does
not run every other step only. While a verify step is in flight no decode retracts anyone (its
rejected drafts' pages come back at its commit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.kv_book import KvBook
from compiled_engine.scheduler.plan import DraftAsk, ReqStep, SlotWrite, StepPlan, TokenWrite
from compiled_engine.scheduler.priority import worst
from compiled_engine.scheduler.request import Request, Status


class DecodePlanner:
    """The running requests (in admission order: retraction takes the last) and their decodes."""

    def __init__(self, config: SchedulerConfig, book: KvBook,
                 requeue: Callable[[Request], None]) -> None:
        """`requeue`: takes a retracted request (to the front of the waiting queue)."""
        self.config, self.book, self._requeue = config, book, requeue
        self.running: list[Request] = []
        self.num_retractions = 0

    def admit(self, reqs: list[Request]) -> None:
        self.running.extend(reqs)

    def drop(self, req: Request) -> None:
        self.running.remove(req)

    def plan(self, draft: StepDraft) -> None:
        """This step's decodes, into `draft` (retracting requests when the pool runs dry), and the
        decodes that may carry drafts (`draft.draft_asks`, their pages taken)."""
        ps = self.book.page_size
        spec = self.config.speculative
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
                spec is not None
                and req.spec.paused_until < draft.step
                and req.spec.drafts_in_batch(spec, len(self.running))
            )
            if drafting and in_flight:
                if draft.step - req.spec.empty_at > spec.empty_retry:
                    continue  # its drafts continue the token in flight: it waits (overlap only)
                drafting = False  # nothing to draft lately: it decodes meanwhile
            pages = req.pages
            if c == len(pages) * ps:
                page = self._page_for(req, draft)
                if page is None:
                    continue
                pages.append(page)
            k = self._draft_room(req, spare, reserve) if drafting and spare > 0 else 0
            if k > 0:
                draft.draft_asks.append(DraftAsk(len(draft.reqs), k))
                spare -= k
            slots = req.slots(ps, c, c + 1)
            step = ReqStep(req.rid, req.row, c, 1, slots, True, lora_slot=req.adapter_slot)
            draft.add(req, step, SlotWrite(req.row, c, slots))
            req.planned_len = c + 1
            req.device_len = d + 1

    def _draft_room(self, req: Request, spare: int, reserve: int) -> int:
        """How many drafts `req`'s next step may carry, as its limits, the budget and the free pages
        beyond `reserve` allow; their pages are taken now (a draft model writes its KV there)."""
        book, ps = self.book, self.book.page_size
        spec = self.config.speculative
        assert spec is not None
        c, pages = req.planned_len, req.pages
        # every accepted draft and the bonus token must fit under max_len
        k = min(req.spec.draft_len(spec), req.max_len - req.device_len - 1, spare)
        need = -(-(c + 1 + k) // ps) - len(pages)
        if k > 0 and need > 0:
            new = book.alloc(need) if need <= book.available_pages() - reserve else None
            if new is None:  # drafts never retract anyone: as many as fit in the last page
                return max(0, len(pages) * ps - c - 1)
            pages.extend(new)
        return max(0, k)

    def add_drafts(self, plan: StepPlan, drafts: Sequence[tuple[int, ...]]) -> StepPlan:
        """`plan` with the proposed drafts (one tuple per `plan.draft_asks`, at most its k) in its
        decodes; the pages past the drafts go back at once (no step has seen them). A request that
        asks runs: once a step has an ask, its planning retracts no one (`_page_for`)."""
        if len(drafts) != len(plan.draft_asks):
            raise ValueError(f"step {plan.step}: {len(drafts)} proposals for "
                             f"{len(plan.draft_asks)} draft asks")
        ps = self.book.page_size
        reqs = list(plan.reqs)
        slot_writes, token_writes = list(plan.slot_writes), list(plan.token_writes)
        for ask, proposed in zip(plan.draft_asks, drafts, strict=True):
            req, rs = plan.members[ask.index], plan.reqs[ask.index]
            tokens = tuple(proposed)[: ask.k]
            if not tokens:
                req.spec.empty_at = plan.step
            c, n = rs.start, len(tokens)
            keep = -(-(c + 1 + n) // ps)
            if len(req.pages) > keep:
                self.book.allocator.free(req.pages[keep:])
                del req.pages[keep:]
            if not tokens:
                continue
            slots = req.slots(ps, c, c + 1 + n)
            reqs[ask.index] = dataclasses.replace(rs, length=1 + n, out_slots=slots, draft=tokens)
            slot_writes.append(SlotWrite(req.row, c + 1, slots[1:]))
            token_writes.append(TokenWrite(req.row, c + 1, tokens))
            req.spec.verify_step = plan.step
            req.planned_len += n
            req.device_len += n
        return dataclasses.replace(
            plan, reqs=tuple(reqs), slot_writes=tuple(slot_writes),
            token_writes=tuple(token_writes), is_decode=all(r.length == 1 for r in reqs),
            draft_asks=(),
        )

    def _page_for(self, req: Request, draft: StepDraft) -> int | None:
        """One new page for a decode, retracting latest-admitted requests when the pool is dry.

        None when `req` itself was retracted, or when pages come back once an in-flight step
        commits (deferred frees, requests that finish at that commit, the pages of rejected
        drafts) or once this step's drafts are proposed (`draft.draft_asks`): `req` then waits a
        step.
        """
        book = self.book
        while True:
            page = book.allocator.alloc_one()
            if page is not None:
                return page
            if book.cache.evict(1):
                continue
            if book.deferred or draft.draft_asks or any(
                (r.planned_len >= r.fill_to and r.device_len == r.max_len)
                or r.spec.verify_step > book.committed  # its rejected drafts' pages come back
                for r in self.running
            ):
                return None
            victim = self._victim(draft.step)
            deferred = victim.last_step > book.committed
            self.retract(victim)
            if victim is req or deferred:
                return None

    def _victim(self, step: int) -> Request:
        """Whom a decode without a page retracts: the latest admitted (fcfs), or the worst rank
        (priority scheduling)."""
        if self.config.policy == "priority":
            return worst(self.running, step, self.config.aging_steps)
        return self.running[-1]

    def retract(self, req: Request) -> None:
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
