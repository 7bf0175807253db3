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

from typing import TYPE_CHECKING

from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.plan import ReqStep, SlotWrite, TokenWrite
from compiled_engine.scheduler.request import Request, Status

if TYPE_CHECKING:
    from compiled_engine.scheduler.scheduler import Scheduler


def plan_decodes(sched: Scheduler, draft: StepDraft) -> None:
    ps = sched.book.page_size
    spec = sched.config.speculative
    speculating = spec is not None and sched.propose is not None
    spare = sched.config.chunk_budget - len(sched.running)  # budget left for draft tokens
    committed = sched.book.committed
    # pages the decodes of this step need: drafts leave them
    reserve = sum(1 for r in sched.running if _decodes(r) and r.planned_len == len(r.pages) * ps)
    for req in list(sched.running):
        c = req.planned_len
        d = req.device_len
        if req.status is not Status.RUNNING or not _decodes(req):
            continue  # retracted in this loop, still prefilling, or finishing at a pending commit
        if c == len(req.pages) * ps:
            reserve -= 1
        in_flight = req.last_step > committed
        if in_flight and (req.params.constrained or req.spec.verify_step > committed):
            continue  # its mask, or its lengths, need the step in flight: it waits (overlap only)
        drafting = (
            speculating
            and req.spec.paused_until < draft.step
            and req.spec.drafts_in_batch(spec, len(sched.running))
        )
        if drafting and in_flight:
            if draft.step - req.spec.empty_at > spec.empty_retry:
                continue  # its drafts continue the token in flight: it waits (overlap only)
            drafting = False  # nothing to draft lately: it decodes meanwhile
        pages = req.pages
        if c == len(pages) * ps:
            page = _page_for(sched, req)
            if page is None:
                continue
            pages.append(page)
        drafts = _drafts(sched, req, draft.step, spare, reserve) if drafting and spare > 0 else ()
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


def _decodes(req: Request) -> bool:
    """Whether a running request decodes (its prompt computed, room left)."""
    return req.planned_len >= req.fill_to and req.device_len < req.max_len


def _drafts(sched: Scheduler, req: Request, step: int, spare: int, reserve: int
            ) -> tuple[int, ...]:
    """The draft tokens of `req`'s next step, as many as its limits, the budget and the free pages
    beyond `reserve` allow. Their pages are taken before the proposer runs (a draft model writes
    its own KV there) and those past the drafts it returns are given back at once (no step has seen
    them)."""
    book, ps = sched.book, sched.book.page_size
    assert sched.config.speculative is not None and sched.propose is not None
    c, pages = req.planned_len, req.pages
    # every accepted draft and the bonus token must fit under max_len
    k = min(req.spec.draft_len(sched.config.speculative), req.max_len - req.device_len - 1, spare)
    need = -(-(c + 1 + k) // ps) - len(pages)
    if k > 0 and need > 0:
        new = book.alloc(need) if need <= book.available_pages() - reserve else None
        if new is None:  # drafts never retract anyone: as many as fit in the last page
            k = len(pages) * ps - c - 1
        else:
            pages.extend(new)
    drafts = ()
    if k > 0:
        drafts = tuple(sched.propose(req, k))[:k]
        if not drafts:
            req.spec.empty_at = step
    keep = -(-(c + 1 + len(drafts)) // ps)
    if len(pages) > keep:
        book.allocator.free(pages[keep:])
        del pages[keep:]
    return drafts


def _page_for(sched: Scheduler, req: Request) -> int | None:
    """One new page for a decode, retracting latest-admitted requests when the pool is dry.

    None when `req` itself was retracted, or when pages come back once an in-flight step commits
    (deferred frees, requests that finish at that commit, the pages of rejected drafts): `req` then
    waits a step.
    """
    book = sched.book
    while True:
        page = book.allocator.alloc_one()
        if page is not None:
            return page
        if book.cache.evict(1):
            continue
        if book.deferred or any(
            (r.planned_len >= r.fill_to and r.device_len == r.max_len)
            or r.spec.verify_step > book.committed  # its rejected drafts' pages come back
            for r in sched.running
        ):
            return None
        victim = sched.running[-1]
        deferred = victim.last_step > book.committed
        sched.retract(victim)
        if victim is req or deferred:
            return None
