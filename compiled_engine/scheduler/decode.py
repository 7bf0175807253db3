"""Decode planning: one new token for every running request whose prompt is computed, a new page
where its last one is full, and retraction of the latest-admitted requests when the pool runs dry.
Under overlap a constrained request (structured output) skips a step while its previous token is in
flight: its token mask is computed from that token. Unconstrained requests never wait for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.plan import ReqStep, SlotWrite
from compiled_engine.scheduler.request import Request, Status

if TYPE_CHECKING:
    from compiled_engine.scheduler.scheduler import Scheduler


def plan_decodes(sched: Scheduler, draft: StepDraft) -> None:
    ps = sched.book.page_size
    for req in list(sched.running):
        c = req.planned_len
        d = req.device_len
        if req.status is not Status.RUNNING or c < req.fill_to or d >= req.max_len:
            continue  # retracted in this loop, still prefilling, or finishing at a pending commit
        if req.params.constrained and req.last_step > sched.book.committed:
            continue  # its mask needs the token still in flight: it waits one step (overlap only)
        pages = req.pages
        if c == len(pages) * ps:
            page = _page_for(sched, req)
            if page is None:
                continue
            pages.append(page)
        slots = (pages[c // ps] * ps + c % ps,)
        draft.add(req, ReqStep(req.rid, req.row, c, 1, slots, True), SlotWrite(req.row, c, slots))
        req.planned_len = c + 1
        req.device_len = d + 1


def _page_for(sched: Scheduler, req: Request) -> int | None:
    """One new page for a decode, retracting latest-admitted requests when the pool is dry.

    None when `req` itself was retracted, or when pages come back once an in-flight step commits
    (deferred frees, requests that finish at that commit): `req` then waits a step.
    """
    book = sched.book
    while True:
        page = book.allocator.alloc_one()
        if page is not None:
            return page
        if book.cache.evict(1):
            continue
        if book.deferred or any(
            r.planned_len >= r.fill_to and r.device_len == r.max_len for r in sched.running
        ):
            return None
        victim = sched.running[-1]
        deferred = victim.last_step > book.committed
        sched.retract(victim)
        if victim is req or deferred:
            return None
