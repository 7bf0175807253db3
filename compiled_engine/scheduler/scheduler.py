"""The scheduler: the coordinator of the ledger. It takes inputs (add_request, abort, finish), plans
each step with its two planners (`DecodePlanner` owns the running requests, `PrefillPlanner` the
waiting queue: a mixed step takes the decodes, then prefill chunks under the token budget), commits
the sampled tokens (finish rules, prefix caching) and keeps the books of pages, rows and locks in a
`KvBook`.

Every decision depends only on the sequence of calls (add_request / abort / finish / schedule /
commit): lists and insertion-ordered dicts only, no set iteration, no clocks, no ids.

Overlap: `schedule()` for step k+1 may run before `commit()` of step k; the KvBook defers every
release until no in-flight step can touch it, and a token sampled after its request ended is
dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from compiled_engine.scheduler.allocator import PageAllocator
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.decode import DecodePlanner
from compiled_engine.scheduler.draft import StepDraft
from compiled_engine.scheduler.integrity import check_integrity
from compiled_engine.scheduler.kv_book import KvBook
from compiled_engine.scheduler.plan import ReqStep, StepOutput, StepPlan, TokenEvent
from compiled_engine.scheduler.prefill import PrefillPlanner
from compiled_engine.scheduler.prefix_cache import PrefixCache
from compiled_engine.scheduler.priority import preempts, rank, worst
from compiled_engine.scheduler.request import (
    LedgerParams,
    Request,
    RequestHooks,
    Status,
    TokenRejected,
)
from compiled_engine.scheduler.speculation import SpecCounters, accepted_prefix
from compiled_engine.scheduler.validation import RequestRejected, check_request

MAX_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_free_pages: int
    num_cached_pages: int  # pages held by the prefix cache
    kv_usage: float  # fraction of usable pages not on the free list
    cache_hit_rate: float  # prefix tokens reused / prompt tokens looked up at admission
    num_retractions: int
    # speculative decoding, totals (vLLM's spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # prompt tokens looked up in the prefix cache at admission, and found there (totals)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    tier_hit_tokens: int = 0  # prompt tokens loaded from the KV tier
    prefill_tokens: int = 0  # positions computed by prefill chunks (recomputation included)
    num_preemptions: int = 0  # priority scheduling: running requests retracted for a better rank


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.spec = SpecCounters()
        self.book = KvBook(config)
        self.prefills = PrefillPlanner(config, self.book)
        self.decodes = DecodePlanner(config, self.book, self.prefills.requeue)
        self.live: dict[str, Request] = {}  # waiting or running
        self.inflight: deque[StepPlan] = deque()
        self._eos = frozenset(config.eos_token_ids)
        self._next_step = 0
        self._arrivals = 0
        self.num_preemptions = 0  # running requests retracted for a waiting one of a better rank

    @property
    def running(self) -> Sequence[Request]:
        """In admission order (retraction takes the last)."""
        return self.decodes.running

    @property
    def waiting(self) -> Sequence[Request]:
        return self.prefills.waiting

    @property
    def num_retractions(self) -> int:
        return self.decodes.num_retractions

    @property
    def num_prefix_waits(self) -> int:
        """Steps a waiting request deferred admission to share a running prefill."""
        return self.prefills.num_prefix_waits

    @property
    def allocator(self) -> PageAllocator:
        return self.book.allocator

    @property
    def cache(self) -> PrefixCache:
        return self.book.cache

    # -- inputs ----------------------------------------------------------------------------------

    def add_request(self, rid: str, prompt_token_ids: list[int] | tuple[int, ...],
                    params: LedgerParams | None = None,
                    hooks: RequestHooks | None = None) -> Request:
        """Queue a request; RequestRejected (a ValueError) with a clear message if it can never run.
        `hooks` hang off the ledger entry (`Request.hooks`) until the request ends."""
        params = params if params is not None else LedgerParams()
        prompt = tuple(prompt_token_ids)
        cfg = self.config
        check_request(rid, prompt, params, cfg.max_context, cfg.capacity_tokens, cfg.vocab_size,
                      cfg.max_loras, cfg.policy)
        if rid in self.live:
            raise RequestRejected(f"request {rid!r}: a live request already has this id")
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos
        max_len = min(len(prompt) + params.max_tokens, cfg.max_context, cfg.capacity_tokens + 1)
        req = Request(rid, prompt, params, max_len, stop_ids, device_len=len(prompt), hooks=hooks,
                      arrival=self._arrivals, arrival_step=self._next_step)
        self._arrivals += 1
        self.live[rid] = req
        self.prefills.waiting.append(req)
        return req

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; unknown or already finished ids are ignored."""
        req = self.live.get(rid)
        if req is not None:
            self._end(req, Status.ABORTED, "abort")

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request from outside (the detokenizer matched a stop string). No event is
        emitted."""
        req = self.live.get(rid)
        if req is not None:
            self._end(req, Status.FINISHED, reason)

    def forget_adapter(self, adapter: int) -> bool:
        """Empty the slot of an adapter the engine unloads; False while a live request uses it."""
        if any(r.params.adapter == adapter for r in self.live.values()):
            return False
        return self.book.adapters.forget(adapter)

    def has_work(self) -> bool:
        return bool(self.prefills.waiting or self.decodes.running or self.inflight)

    # -- planning --------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when nothing can run now (commit in-flight steps first).
        With speculative decoding the plan may ask for drafts (`StepPlan.draft_asks`): propose
        them, then launch `add_drafts(plan, drafts)` instead."""
        if len(self.inflight) >= MAX_IN_FLIGHT:
            raise RuntimeError(f"at most {MAX_IN_FLIGHT} steps may be in flight: commit one first")
        draft = StepDraft(self._next_step)
        budget = self.config.chunk_budget
        if self.config.policy == "priority":
            self._preempt(draft.step)
            self.prefills.order_by_rank(draft.step)
        if self.config.mixed:
            self.decodes.plan(draft)
            asked = sum(a.k for a in draft.draft_asks)
            self._plan_prefills(draft, budget - sum(r.length for r in draft.reqs) - asked)
        else:
            self._plan_prefills(draft, budget)
            if not draft.reqs:
                self.decodes.plan(draft)
        if not draft.reqs:
            return None
        self._next_step += 1
        plan = StepPlan(
            step=draft.step,
            reqs=tuple(draft.reqs),
            slot_writes=tuple(self.book.take_rewrites() + draft.slot_writes),
            token_writes=tuple(draft.token_writes),
            is_decode=all(r.length == 1 for r in draft.reqs),
            members=tuple(draft.members),
            draft_asks=tuple(draft.draft_asks),
            adapter_loads=self.book.adapters.take_loads(),
            tier_loads=tuple(draft.tier_loads),
        )
        self.inflight.append(plan)
        return plan

    def add_drafts(self, plan: StepPlan, drafts: Sequence[tuple[int, ...]]) -> StepPlan:
        """The step to launch for the latest plan: its decodes with their proposed drafts (one
        tuple per `plan.draft_asks`, each at most as long as asked, empty for none)."""
        if not self.inflight or self.inflight[-1] is not plan:
            raise ValueError(f"drafts for step {plan.step}: only the latest plan takes drafts")
        with_drafts = self.decodes.add_drafts(plan, drafts)
        self.inflight[-1] = with_drafts
        return with_drafts

    def _preempt(self, step: int) -> None:
        """Retract the running request of the worst rank if the best waiting request cannot be
        admitted now, even with the pages that come back once the steps in flight commit, and may
        preempt it (`priority.preempts`). One per step; a request whose verify step is in flight,
        or that finishes at a pending commit, is not retracted."""
        aging = self.config.aging_steps
        head = min(self.prefills.waiting, key=lambda r: rank(r, step, aging), default=None)
        book = self.book
        if head is None or head.last_step > book.committed:
            return  # (retracted with a token in flight: it waits for that commit anyway)
        coming = sum(len(d.pages) for d in book.deferred)  # back once steps in flight commit
        if not self.prefills.blocked(head, self.running, coming):
            return
        victim = worst((r for r in self.running if r.spec.verify_step <= book.committed
                        and not (r.planned_len >= r.fill_to and r.device_len == r.max_len)),
                       step, aging)
        if victim is not None and preempts(head, victim, step, aging):
            self.decodes.retract(victim)
            self.num_preemptions += 1

    def _plan_prefills(self, draft: StepDraft, budget: int) -> None:
        if self.config.policy == "priority":  # (a decode's retraction requeued at the front)
            self.prefills.order_by_rank(draft.step)
        self.decodes.admit(self.prefills.plan(draft, budget, self.decodes.running))

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, plan: StepPlan, output: StepOutput) -> list[TokenEvent]:
        """Apply the output of the oldest in-flight step: its tokens (a verify step keeps its
        accepted drafts and one more), their log-probs, the sampler's errors. Returns the step's
        events: the one place where a request ends by what it drew."""
        if not self.inflight or self.inflight[0] is not plan:
            raise ValueError(
                f"commit of step {plan.step} out of order: steps are committed as planned"
            )
        self.inflight.popleft()
        self.book.committed = plan.step
        tokens, errors = output.tokens, output.errors
        row = 0  # the step's first sampled row of the request
        events: list[TokenEvent] = []
        for rs, req in zip(plan.reqs, plan.members, strict=True):
            status = req.status
            if rs.sample:
                first, row = row, row + rs.num_sampled
                if status is Status.FINISHED or status is Status.ABORTED:
                    continue  # planned before the request ended: the tokens are discarded
                if errors and (error := _first_error(errors, first, row)) is not None:
                    events.append(self._fail(req, error))  # its tokens are dropped
                    continue
                sampled = tokens[first:row]
                if rs.draft:
                    sampled = self._verified(plan.step, rs, req, sampled)
                if not self._take(req, sampled, output, first, events) and (
                    status is Status.RUNNING and rs.start < req.fill_to
                ):
                    self.book.cache_prefix(req, rs.start + rs.length)
            elif status is Status.RUNNING:
                if req.device_len == req.max_len and req.planned_len == req.device_len:
                    events.append(TokenEvent(req.rid, None, True, "length", **_first_fields(req)))
                    self._end(req, Status.FINISHED, "length")  # max_tokens == 0
                else:
                    self.book.cache_prefix(req, rs.start + rs.length)
        if row != len(tokens):
            raise ValueError(
                f"step {plan.step}: {len(tokens)} sampled tokens for {row} sampling rows"
            )
        self.book.commit_step(plan.step)
        return events

    def _take(self, req: Request, sampled: list[int], output: StepOutput, first: int,
              events: list[TokenEvent]) -> bool:
        """Append the request's sampled tokens (rows first, first + 1, ...) and their events;
        True when one ended the request (a token its hooks reject fails it, dropped)."""
        hooks = req.hooks
        judge = hooks.on_token if hooks is not None and req.params.constrained else None
        n = hooks.logprobs if hooks is not None and output.logprobs is not None else None
        for i, tok in enumerate(sampled, first):
            complete = False
            if judge is not None:
                try:
                    complete = judge(tok)
                except TokenRejected as e:
                    events.append(self._fail(req, str(e)))
                    return True
            req.output.append(tok)
            reason = self._finish_reason(req, tok) or ("stop" if complete else None)
            lp = top = None
            if n is not None:
                lp = output.logprobs[i]
                top = output.top_logprobs[i][:n] if output.top_logprobs is not None else []
            if reason is not None:
                self._end(req, Status.FINISHED, reason)
            fields = _first_fields(req) if len(req.output) == 1 else {}
            events.append(TokenEvent(req.rid, tok, reason is not None, reason, lp, top, **fields))
            if reason is not None:
                return True
        return False

    def _fail(self, req: Request, message: str) -> TokenEvent:
        """End a request with finish_reason "error"."""
        self._end(req, Status.FINISHED, "error")
        return TokenEvent(req.rid, None, True, "error", error=message)

    def _verified(self, step: int, rs: ReqStep, req: Request, sampled: list[int]) -> list[int]:
        """The tokens a verify step keeps: the accepted drafts and the draw after them. A running
        request gives back the positions of its rejected drafts (their KV slots, whole pages freed);
        a retracted one only learns its tokens."""
        j = accepted_prefix(rs.draft, sampled)
        self.spec.num_drafts += 1
        self.spec.num_draft_tokens += len(rs.draft)
        self.spec.num_accepted_tokens += j
        if self.config.speculative is not None:
            req.spec.record(self.config.speculative, step, len(rs.draft), j)
        if req.status is Status.RUNNING:
            self.book.truncate(req, rs.start + 1 + j)
        req.device_len = req.known_len + j + 1
        return sampled[: j + 1]

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        n_out = len(req.output)
        if tok in req.stop_ids and n_out > req.params.min_tokens:
            return "stop"
        if len(req.prompt) + n_out >= req.max_len:
            return "length"
        return None

    def _end(self, req: Request, status: Status, reason: str) -> None:
        was = req.status
        req.status = status
        req.finish_reason = reason
        del self.live[req.rid]
        if was is Status.RUNNING:
            self.decodes.drop(req)
            self.book.release(req)
        else:
            self.prefills.waiting.remove(req)  # holds nothing (new, or retracted and released)

    # -- inspection ------------------------------------------------------------------------------

    def get_request(self, rid: str) -> Request | None:
        return self.live.get(rid)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        allocator = self.book.allocator
        total, free = allocator.total, allocator.num_free
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_pages=free,
            num_cached_pages=self.book.cache.num_cached_pages,
            kv_usage=(total - free) / total,
            cache_hit_rate=self.book.cache.hit_rate,
            num_retractions=self.num_retractions,
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
            prefix_cache_queries=self.book.cache.queried_tokens,
            prefix_cache_hits=self.book.cache.hit_tokens,
            tier_hit_tokens=self.book.tier_hit_tokens,
            prefill_tokens=self.book.prefill_tokens,
            num_preemptions=self.num_preemptions,
        )

    def check_integrity(self) -> None:
        """Assert every ledger invariant (see `integrity.py`); AssertionError names the breach."""
        check_integrity(self.book, self.config, self.live, self.running, self.waiting,
                        self.inflight)


def _first_fields(req: Request) -> dict:
    """The fields of a request's first event: its cached prompt tokens and its hooks'
    (`RequestHooks.first_event`)."""
    hooks = req.hooks.first_event() if req.hooks is not None else {}
    return {"cached_tokens": max(req.cached_tokens, 0)} | hooks


def _first_error(errors: dict[int, str], lo: int, hi: int) -> str | None:
    """The sampler's error at the first of rows [lo, hi) that has one."""
    return next((errors[i] for i in range(lo, hi) if i in errors), None)
