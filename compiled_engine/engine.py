"""The engine loop: scheduler plan -> model runner -> commit, with overlap scheduling.

With overlap (the default on CUDA) step k+1 is planned and launched before step k's tokens reach the
host, and the token sampled at step k is read from the device token table by step k+1. On CUDA a
launch only queues work (`ModelRunner.asynchronous`): this thread launches step k+1, then waits for
step k's tokens (the one host sync of a step) while the device runs k+1. On the CPU, where a launch
computes, the forward runs in a worker thread instead. The scheduler defers frees until no in-flight
step can touch the pages, and drops tokens sampled after a request finished.

Structured output: a constrained request's grammar fills its token mask when its step is launched
and advances when its token commits; the request ends when the grammar does, and fails
(finish_reason "error") if a token its grammar rejects is sampled or its mask allows nothing: it
never goes on unconstrained. Under overlap the scheduler does not plan a constrained request while
its previous token is in flight, so a mask is always computed from committed tokens, and
unconstrained requests never wait for one.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.constraints import GrammarBook, RequestGrammar
from compiled_engine.jax import bridge
from compiled_engine.prompt_record import PromptRecord
from compiled_engine.runner.model_runner import ModelRunner, PendingStep, StepOutput
from compiled_engine.runner.prompt_outputs import KeptRows
from compiled_engine.runner.sampler import SamplingRow, needs_history
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import ReqStep, StepPlan, TokenEvent
from compiled_engine.scheduler.request import Request
from compiled_engine.scheduler.scheduler import Scheduler
from compiled_engine.scheduler.validation import RequestRejected
from compiled_engine.speculative.config import SpeculativeConfig
from compiled_engine.speculative.draft_model import DraftModel, DraftModelDrafter
from compiled_engine.speculative.ngram import NgramDrafter

Drafter = NgramDrafter | DraftModelDrafter

if TYPE_CHECKING:
    from compiled_engine.kv_events.publisher import KVEventPublisher
    from compiled_engine.runner.compile_cache.session import CompileReport

log = logging.getLogger(__name__)


@dataclass(slots=True, weakref_slot=True)  # tests check that nothing holds it once its request ends
class RequestState:
    """What the engine keeps about one request. It hangs off the request's ledger entry
    (`Request.engine_state`), so it ends with it: there is no other registry to clear."""

    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...]  # EOS / stop ids, masked while fewer than min_tokens were generated
    grammar: RequestGrammar | None = None  # structured output
    drafter: Drafter | None = None  # speculative decoding: proposes the request's drafts
    # prompt log-probs / an embedding's hidden states, until its first event carries them
    prompt: PromptRecord | None = None


@dataclass(slots=True)
class _Launched:
    """A step in flight: its plan, the state of the request of each token it samples (in plan
    order, taken at launch: a request may end before the step commits), and its tokens on their
    way."""

    plan: StepPlan
    sampled: list[RequestState]
    pending: Future | PendingStep
    # what the step keeps of prompt positions, with the state of each such request
    kept: list[tuple[KeptRows, RequestState]] = field(default_factory=list)
    # the requests of the step whose first event carries their prompt record
    records: dict[str, PromptRecord] = field(default_factory=dict)


class Engine:
    """One TP rank's engine. Callers add requests, then call `step()` until `has_work()` is
    false."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        scheduler: Scheduler,
        runner: ModelRunner,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        grammars: GrammarBook | None = None,
        compile_report: CompileReport | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: DraftModel | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.config, self.model, self.scheduler, self.runner = config, model, scheduler, runner
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.grammars = grammars  # structured output (None: no tokenizer, no constraints)
        self.compile_report = compile_report  # None: eager
        self.speculative = speculative
        self.draft_model = draft_model  # speculative method draft_model
        self.kv_events = kv_events  # gets the prefix cache's events of each step
        if speculative is not None:
            scheduler.propose = self._propose
        self._inflight: collections.deque[_Launched] = collections.deque()
        self._overlap = bool(config.overlap)
        # overlap's forward thread, on a synchronous device
        self._worker: ThreadPoolExecutor | None = None
        self.steps = 0
        # the plan of the latest step() (the TP debug digest reads it)
        self.last_plan: StepPlan | None = None
        # requests whose prompt record no event has carried yet (the rest skip that bookkeeping)
        self._recording: set[str] = set()

    @property
    def compile_summary(self) -> str:
        return (
            self.compile_report.summary()
            if self.compile_report is not None
            else "eager: no graphs compiled"
        )

    # ---- inputs -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises RequestRejected (a ValueError) with a clear message if it can
        never run. The sampling parameters are validated here, the ledger's own by the scheduler."""
        check_sampling(rid, params)
        grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise RequestRejected(
                    f"request {rid!r}: this engine serves no structured output (no tokenizer)"
                )
            # ValueError if bad
            grammar = self.grammars.for_request(params.structured, params.stop_token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        banned = (
            tuple(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)))
            if params.min_tokens
            else ()
        )
        state = RequestState(params, generator, banned, grammar, self._drafter(params),
                             PromptRecord.for_request(params, len(prompt_ids)))
        # checks the rest
        self.scheduler.add_request(rid, prompt_ids, params.ledger_params(), state)
        if state.prompt is not None:
            self._recording.add(rid)

    def _drafter(self, params: SamplingParams) -> Drafter | None:
        """A request's drafter; none with logits processors (a processor's error at a draft's
        position would end a request that never reaches that position)."""
        spec = self.speculative
        if spec is None or params.logits_processors:
            return None
        if self.draft_model is not None:
            return self.draft_model.drafter()
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _propose(self, req: Request, k: int) -> tuple[int, ...]:
        """The scheduler's `propose`: up to k drafts after the request's known tokens, cut where its
        grammar would reject them."""
        state: RequestState = req.engine_state
        if state.drafter is None:
            return ()
        drafts = state.drafter.propose(req, k)
        if drafts and state.grammar is not None:
            drafts = state.grammar.allowed_prefix(drafts)
        return drafts

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self._recording.discard(rid)
        self._publish_cache_events()

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request early (a stop string matched on the detokenized text)."""
        self.scheduler.finish(rid, reason)
        self._recording.discard(rid)
        self._publish_cache_events()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Plan and launch one step; commit the previous one (overlap) or this one. Returns the
        events."""
        plan = self.scheduler.schedule()
        self.last_plan = plan
        if plan is not None:
            self._inflight.append(self._launch(plan))
            self.steps += 1
        keep = 1 if (self._overlap and plan is not None) else 0
        events: list[TokenEvent] = []
        while len(self._inflight) > keep:
            done = self._inflight.popleft()
            events.extend(self._commit(done, done.pending.result()))
        self._publish_cache_events()
        return events

    def _publish_cache_events(self) -> None:
        """Hand what the prefix cache stored and evicted since last time to the KV event
        publisher."""
        if self.kv_events is None:
            return
        cache = self.scheduler.cache
        if cache.events:
            self.kv_events.publish(cache.events)
            cache.events = []

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        # `startup.build_engine` froze the engine's objects: they may be collected again
        gc.unfreeze()

    def _launch(self, plan: StepPlan) -> _Launched:
        # Every request of a plan is live until its step is launched (nothing runs in between).
        sampled = [
            (step, self.scheduler.get_request(step.rid)) for step in plan.reqs if step.sample
        ]
        # The sampler's rows (token masks included) now, on this thread: under overlap the previous
        # step's forward runs meanwhile.
        sampling = [row for step, req in sampled for row in _sampling_rows(step, req)]
        states = [req.engine_state for step, req in sampled for _ in range(step.num_sampled)]
        kept, records = self._prompt_outputs(plan)
        rows = [k for k, _ in kept]
        if not self._overlap or self.runner.asynchronous:
            pending = self.runner.launch(plan, sampling, rows)
        else:
            # a synchronous device computes in its launch: overlap runs it on a thread
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, "forward")
            pending = self._worker.submit(self.runner.execute, plan, sampling, rows)
        return _Launched(plan, states, pending, kept, records)

    def _prompt_outputs(
        self, plan: StepPlan
    ) -> tuple[list[tuple[KeptRows, RequestState]], dict[str, PromptRecord]]:
        """What the plan's prefill chunks keep of their prompt positions, and the prompt records of
        the plan's requests that still owe their first event."""
        kept, records = [], {}
        if not self._recording:
            return kept, records
        for i, step in enumerate(plan.reqs):
            if step.rid not in self._recording:
                continue
            req = self.scheduler.get_request(step.rid)
            state: RequestState = req.engine_state
            if state.prompt is None or state.prompt.delivered or req.output:
                continue
            records[step.rid] = state.prompt
            if step.start < len(req.prompt):
                rows = state.prompt.wanted(step, i)
                if rows is not None:
                    kept.append((rows, state))
        return kept, records

    def _commit(self, launched: _Launched, output: StepOutput) -> list[TokenEvent]:
        plan = launched.plan
        _fold_prompt_outputs(launched, output)
        rids = [r.rid for r in plan.reqs for _ in range(r.num_sampled)]  # of each sampled token
        events = self._fail_rows(rids, output.errors) if output.errors else []
        # a request's sampled tokens in order: its events take them one by one (a verify step
        # keeps its accepted drafts and one more)
        by_rid: dict[str, collections.deque[tuple[RequestState, float | None, list | None]]] = {}
        for i, (rid, state) in enumerate(zip(rids, launched.sampled)):
            lp = top = None
            if output.logprobs is not None and state.params.logprobs is not None:
                lp = output.logprobs[i]
                top = (
                    output.top_logprobs[i][: state.params.logprobs]
                    if output.top_logprobs is not None
                    else []
                )
            by_rid.setdefault(rid, collections.deque()).append((state, lp, top))
        for ev in self.scheduler.commit(plan, output.tokens):
            record = launched.records.get(ev.rid)
            if record is not None and not record.delivered:
                ev = dataclasses.replace(ev, **record.deliver())
                self._recording.discard(ev.rid)
            if ev.token is None:
                events.append(ev)
                continue
            state, lp, top = by_rid[ev.rid].popleft()
            finished, reason = ev.finished, ev.finish_reason
            grammar = state.grammar
            # also a last token ("length", EOS)
            if grammar is not None and not grammar.accept(ev.token):
                # the token is dropped
                events.append(self._fail(ev.rid, _rejected(state, ev.token)))
                continue
            if grammar is not None and not finished and grammar.terminated:
                self.scheduler.finish(ev.rid, "stop")  # the document is complete
                finished, reason = True, "stop"
            events.append(TokenEvent(ev.rid, ev.token, finished, reason, lp, top,
                                     prompt_logprobs=ev.prompt_logprobs, embedding=ev.embedding))
        return events

    def _fail_rows(self, rids: list[str], errors: dict[int, str]) -> list[TokenEvent]:
        """End the requests whose row failed in the sampler (a logits processor, a mask that allows
        nothing): their tokens of this step are dropped. One that ended meanwhile (aborted) gets no
        event."""
        live: dict[str, str] = {}
        for i, message in sorted(errors.items()):
            live.setdefault(rids[i], message)
        return [
            self._fail(rid, message)
            for rid, message in live.items()
            if self.scheduler.get_request(rid) is not None
        ]

    def _fail(self, rid: str, message: str) -> TokenEvent:
        """End a request with finish_reason "error" (a no-op in the ledger when its last token ended
        it)."""
        self.scheduler.finish(rid, "error")
        self._recording.discard(rid)
        return TokenEvent(rid, None, True, "error", error=message)


def _fold_prompt_outputs(launched: _Launched, output: StepOutput) -> None:
    """Hand each kept prompt chunk's log-probs and hidden states to its request's record."""
    logprobs = iter(output.prompt_logprobs or [])
    hidden = iter(output.hidden or [])
    for rows, state in launched.kept:
        step = launched.plan.reqs[rows.index]
        chunk = [next(logprobs) for _ in range(rows.num_logprobs)]
        state.prompt.add(step, chunk, next(hidden) if rows.hidden else None)


def check_sampling(rid: str, params: SamplingParams) -> None:
    """RequestRejected naming the first bad sampling parameter, or a logits processor name that
    cannot be imported (before anything is queued). The ledger checks its own fields."""
    try:
        params.validate()
        for processor in params.logits_processors:
            bridge.resolve(processor)
    except ValueError as e:
        raise RequestRejected(f"request {rid!r}: {e}") from None


def _sampling_rows(step: ReqStep, req: Request) -> list[SamplingRow]:
    """The sampler's view of one request in this step, one row per token it draws (a verify step:
    one per verified position): bans until min_tokens, its grammar's token mask, where its token
    history lies in the token table (for penalties and logits processors), and the position of the
    token drawn."""
    state: RequestState = req.engine_state
    params, prompt_len = state.params, len(req.prompt)
    first = step.start + step.length - step.num_sampled  # position of the first sampling row
    masks = state.grammar.masks_along(step.draft) if state.grammar is not None else None
    rows = []
    for j in range(step.num_sampled):
        seq_len = first + j + 1
        banned = state.banned if seq_len - prompt_len < params.min_tokens else ()
        mask = None
        if masks is not None:
            mask, complete = masks[j]
            if complete:
                banned = ()  # a complete document ends now, min_tokens or not
        history = (step.row, prompt_len, seq_len) if needs_history(params) else None
        rows.append(SamplingRow(params, state.generator, banned, token_mask=mask, history=history,
                                position=seq_len))
    return rows


def _rejected(state: RequestState, token: int) -> str:
    """Why a constrained request fails when its grammar rejects the token it drew."""
    return (
        f"structured output: token {token} was sampled, which the {state.params.structured.kind} "
        "constraint does not allow (were all the tokens it allows ruled out, by logit_bias or a "
        "logits processor?)"
    )
