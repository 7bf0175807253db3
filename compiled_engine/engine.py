"""The engine loop: scheduler plan -> model runner -> commit, with overlap scheduling.

With overlap (the default on CUDA) step k+1 is planned and launched before step k's tokens reach the host,
and the token sampled at step k is read from the device token table by step k+1. On CUDA a launch only queues
work (`ModelRunner.asynchronous`): this thread launches step k+1, then waits for step k's tokens (the one host
sync of a step) while the device runs k+1. On the CPU, where a launch computes, the forward runs in a worker
thread instead. The scheduler defers frees until no in-flight step can touch the pages, and drops tokens
sampled after a request finished.

Structured output: a constrained request's grammar fills its token mask when its step is launched and
advances when its token commits; the request ends when the grammar does, and fails (finish_reason "error")
if a token its grammar rejects is sampled or its mask allows nothing: it never goes on unconstrained. Under
overlap the scheduler does not plan a constrained request while its previous token is in flight, so a mask
is always computed from committed tokens, and unconstrained requests never wait for one.
"""

from __future__ import annotations

import collections
import gc
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.constraints import GrammarBook, RequestGrammar
from compiled_engine.jax import bridge
from compiled_engine.runner.model_runner import ModelRunner, PendingStep, StepOutput
from compiled_engine.runner.sampler import SamplingRow, needs_history
from compiled_engine.runner.step_inputs import StepInputs
from compiled_engine.scheduler.plan import Batch, TokenEvent
from compiled_engine.scheduler.sampling_params import SamplingParams
from compiled_engine.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from compiled_engine.runner.compile_cache.session import CompileReport

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Live:
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...]  # EOS / stop ids, masked while fewer than min_tokens were generated
    grammar: RequestGrammar | None = None  # structured output


class Engine:
    """One TP rank's engine. Callers add requests, then call `step()` until `has_work()` is false."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, scheduler: Scheduler, runner: ModelRunner,
                 eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        self.config, self.model, self.scheduler, self.runner = config, model, scheduler, runner
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._live: dict[str, _Live] = {}
        self._inflight: collections.deque[tuple[Batch, Future | PendingStep]] = collections.deque()
        self._overlap = bool(config.overlap)
        self._worker: ThreadPoolExecutor | None = None  # overlap's forward thread, on a synchronous device
        self.steps = 0
        self.last_batch: Batch | None = None  # the plan of the latest step() (the TP debug digest reads it)
        self.compile_report: CompileReport | None = None  # set by build_engine (None: eager)
        self.grammars: GrammarBook | None = None  # set by build_engine: structured output

    @property
    def compile_summary(self) -> str:
        return self.compile_report.summary() if self.compile_report is not None else "eager: no graphs compiled"

    # ---- inputs -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError (RequestRejected; ConstraintError for a constraint that does not
        compile) with a clear message if it can never run."""
        if params.structured is not None and self.grammars is None:
            raise ValueError(f"request {rid!r}: this engine serves no structured output (no tokenizer)")
        for processor in params.logits_processors:
            bridge.resolve(processor)  # a name that cannot be imported: ValueError now, before anything is queued
        self.scheduler.add_request(rid, prompt_ids, params)  # validates it (the one check of its parameters)
        grammar = None
        if params.structured is not None:
            try:  # compiled here only: the server leaves a bad constraint's 400 to this
                grammar = self.grammars.for_request(params.structured, params.stop_token_ids)
            except ValueError:
                self.scheduler.abort(rid)
                raise
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        banned = tuple(sorted(set(self.eos_token_ids) | set(params.stop_token_ids))) if params.min_tokens else ()
        self._live[rid] = _Live(len(prompt_ids), params, generator, banned, grammar)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self._live.pop(rid, None)

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request early (a stop string matched on the detokenized text)."""
        self.scheduler.finish(rid, reason)
        self._live.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Plan and launch one step; commit the previous one (overlap) or this one. Returns the events."""
        batch = self.scheduler.schedule()
        self.last_batch = batch
        if batch is not None:
            self._inflight.append((batch, self._launch(batch)))
            self.steps += 1
        keep = 1 if (self._overlap and batch is not None) else 0
        events: list[TokenEvent] = []
        while len(self._inflight) > keep:
            done, pending = self._inflight.popleft()
            events.extend(self._commit(done, pending.result()))
        return events

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        gc.unfreeze()  # `startup.build_engine` froze the engine's objects: they may be collected again

    def _launch(self, batch: Batch) -> Future | PendingStep:
        live = [self._live.get(r.rid) for r in batch.reqs if r.sample]
        sampled = [r for r in batch.reqs if r.sample]
        # Token masks now, on this thread: under overlap the previous step's forward runs meanwhile.
        masks = [(info.grammar.next_mask(), info.grammar.complete) if info is not None and info.grammar is not None
                 else (None, False) for info in live]

        def rows(inputs: StepInputs) -> list[SamplingRow]:
            out = []
            for req, info, (mask, complete) in zip(sampled, live, masks):
                if info is None:  # aborted or finished while planned: its token is dropped at commit
                    out.append(SamplingRow(req.sampling))
                    continue
                seq_len = req.start + req.length
                generated = seq_len - info.prompt_len
                banned = info.banned if generated < info.params.min_tokens else ()
                if complete:
                    banned = ()  # a complete document ends now, min_tokens or not
                row = SamplingRow(info.params, info.generator, banned, token_mask=mask)
                if needs_history(info.params):
                    row.prompt_ids, row.output_ids = self.runner.history(req.row, info.prompt_len, seq_len)
                out.append(row)
            return out

        if not self._overlap or self.runner.asynchronous:
            return self.runner.launch(batch, rows)
        if self._worker is None:  # a synchronous device computes in its launch: overlap runs it on a thread
            self._worker = ThreadPoolExecutor(1, "forward")
        return self._worker.submit(self.runner.execute, batch, rows)

    def _commit(self, batch: Batch, output: StepOutput) -> list[TokenEvent]:
        events = self._fail_rows(batch, output.errors) if output.errors else []
        extras: dict[str, tuple[float | None, list | None]] = {}
        if output.logprobs is not None:
            sampled = [r for r in batch.reqs if r.sample]
            for i, req in enumerate(sampled):
                top = output.top_logprobs[i] if output.top_logprobs is not None else None
                if req.sampling.logprobs is not None:
                    extras[req.rid] = (output.logprobs[i], top[: req.sampling.logprobs] if top else [])
        for ev in self.scheduler.commit(batch, output.tokens):
            lp, top = extras.get(ev.rid, (None, None)) if ev.token is not None else (None, None)
            finished, reason = ev.finished, ev.finish_reason
            grammar = self._grammar_of(ev.rid) if ev.token is not None else None
            if grammar is not None and not grammar.accept(ev.token):  # also a last token ("length", EOS)
                events.extend(self._fail(ev.rid, self._rejected(ev.rid, ev.token)))  # the token is dropped
                continue
            if grammar is not None and not finished and grammar.terminated:
                self.scheduler.finish(ev.rid, "stop")  # the document is complete
                finished, reason = True, "stop"
            events.append(TokenEvent(ev.rid, ev.token, finished, reason, lp, top))
            if finished:
                self._live.pop(ev.rid, None)
        return events

    def _fail_rows(self, batch: Batch, errors: dict[int, str]) -> list[TokenEvent]:
        """End the requests whose row failed in the sampler (a logits processor, a mask that allows nothing):
        their token of this step is dropped."""
        sampled = [r for r in batch.reqs if r.sample]
        return [ev for i, message in sorted(errors.items()) for ev in self._fail(sampled[i].rid, message)]

    def _fail(self, rid: str, message: str) -> list[TokenEvent]:
        """End a live request with finish_reason "error": its closing event (none if it already ended)."""
        if self._live.pop(rid, None) is None:
            return []
        self.scheduler.finish(rid, "error")
        return [TokenEvent(rid, None, True, "error", error=message)]

    def _rejected(self, rid: str, token: int) -> str:
        """Why a constrained request fails when its grammar rejects the token it drew."""
        kind = self._live[rid].params.structured.kind
        return (f"structured output: token {token} was sampled, which the {kind} constraint does not allow "
                "(were all the tokens it allows ruled out, by logit_bias or a logits processor?)")

    def _grammar_of(self, rid: str) -> RequestGrammar | None:
        info = self._live.get(rid)
        return None if info is None else info.grammar
