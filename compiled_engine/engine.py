"""The engine loop: scheduler plan -> model runner -> commit, with overlap scheduling.

With overlap (the default on CUDA) step k+1 is planned and launched before step k's tokens reach the
host, and the token sampled at step k is read from the device token table by step k+1. On CUDA a
launch only queues work (`ModelRunner.asynchronous`): this thread launches step k+1, then waits for
step k's tokens (the one host sync of a step) while the device runs k+1. On the CPU, where a launch
computes, the forward runs in a worker thread instead. With speculative decoding the drafts a plan
asks for are proposed (n-gram lookup, or the draft model's forwards) between planning and launch.
The scheduler defers frees until no in-flight step can touch the pages, and drops tokens sampled
after a request finished.

A request's features live in its state (`request_state.py`), hung off its ledger entry: the launch
asks each for its sampler rows and the prompt rows to keep; the scheduler's commit asks it about
each token, ends requests and makes every event.

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
import functools
import gc
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.kv_tier.keys import files_identity, salt
from compiled_engine.kv_tier.tier import HostPages
from compiled_engine.lora.weights import AdapterError, AdapterWeights
from compiled_engine.request_state import RequestFeatures, RequestState, propose_drafts
from compiled_engine.runner.model_runner import ModelRunner, PendingStep
from compiled_engine.runner.prompt_outputs import KeptRows
from compiled_engine.runner.sampler import SamplingRow
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import StepOutput, StepPlan, TokenEvent
from compiled_engine.scheduler.prefix_cache import CacheStored
from compiled_engine.scheduler.request import ADAPTER_SHIFT, cache_key_tokens, salt_namespace
from compiled_engine.scheduler.scheduler import Scheduler
from compiled_engine.scheduler.validation import RequestRejected

if TYPE_CHECKING:
    from compiled_engine.kv_events.publisher import KVEventPublisher
    from compiled_engine.kv_tier.tier import KVTier
    from compiled_engine.lora.registry import LoRARegistry
    from compiled_engine.runner.compile_cache.session import CompileReport


@dataclass(slots=True)
class _Launched:
    """A step in flight: its plan, its tokens on their way, and what it keeps of prompt positions
    with the state of each such request."""

    plan: StepPlan
    pending: Future | PendingStep
    kept: list[tuple[KeptRows, RequestState]] = field(default_factory=list)


class Engine:
    """One TP rank's engine. Callers add requests, then call `step()` until `has_work()` is
    false."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        scheduler: Scheduler,
        runner: ModelRunner,
        features: RequestFeatures,
        compile_report: CompileReport | None = None,
        kv_events: KVEventPublisher | None = None,
        lora: LoRARegistry | None = None,
        tier: KVTier | None = None,
    ) -> None:
        self.config, self.model, self.scheduler, self.runner = config, model, scheduler, runner
        self.features = features  # makes each request's state
        self.compile_report = compile_report  # None: eager
        self.kv_events = kv_events  # gets the prefix cache's events of each step
        self.lora = lora  # the adapters served (None: no LoRA)
        self.tier = tier  # the prefix cache's pages on disk (None: no tier)
        self._adapter_seeds: dict[int, bytes] = {}  # the tier's: adapter id -> its files' hash
        self._disk_blocks: dict[bytes, int] = {}  # KV events: a tier page's key -> its block hash
        self._inflight: collections.deque[_Launched] = collections.deque()
        self._overlap = bool(config.overlap)
        # overlap's forward thread, on a synchronous device
        self._worker: ThreadPoolExecutor | None = None
        self.steps = 0
        # keep the plan of the latest step(), without its requests, in `last_plan` (the TP debug
        # digest reads it)
        self.keep_last_plan = False
        self.last_plan: StepPlan | None = None

    @property
    def compile_summary(self) -> str:
        return (
            self.compile_report.summary()
            if self.compile_report is not None
            else "eager: no graphs compiled"
        )

    # ---- inputs -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    compiled_grammar=None, lora_name: str | None = None,
                    host: HostPages | None = None) -> None:
        """Queue a request; raises RequestRejected (a ValueError) with a clear message if it can
        never run. The sampling parameters are checked by `RequestFeatures`, the ledger's own by
        the scheduler. `compiled_grammar`: its constraint, compiled ahead (else compiled here);
        `lora_name`: a loaded adapter's (`add_lora`); `host`: its prompt's pages read from the KV
        tier (`read_tier`)."""
        ledger = params.ledger_params()
        if lora_name is not None:
            ledger = dataclasses.replace(ledger, adapter=self._adapter_id(rid, lora_name))
        if host is not None:
            ledger = dataclasses.replace(ledger, host_pages=(host.first, host.end))
        state = self.features.state(rid, params, len(prompt_ids), compiled_grammar)
        state.host_kv = host
        self.scheduler.add_request(rid, prompt_ids, ledger, state)
        if self.tier is not None:  # its prompt's stored pages stay the store's most recent
            found = self._tier_keys(prompt_ids, lora_name, params.cache_salt)
            if found is not None:
                self.tier.touch(found[0])

    # ---- the KV tier --------------------------------------------------------------------------
    def tier_span(self, prompt_ids: list[int], lora_name: str | None = None,
                  cache_salt: str | None = None) -> tuple[int, int] | None:
        """The prompt's pages [first, end) past the pool's cached prefix that the KV tier has (None:
        none) for a request of `lora_name` and `cache_salt`. Read them with `read_tier` (off the
        step loop: it reads files)."""
        found = self._tier_keys(prompt_ids, lora_name, cache_salt)
        if found is None:
            return None
        keys, tokens = found
        first = self.scheduler.cache.peek(tokens[: len(keys) * self.scheduler.config.page_size])
        end = self.tier.stored_after(keys, first)
        return (first, end) if end > first else None

    def tier_reader(self, prompt_ids: list[int], lora_name: str | None,
                    span: tuple[int, int], cache_salt: str | None = None
                    ) -> Callable[[], HostPages | None]:
        """What reads the prompt's pages `span` from this rank's tier (thread-safe: the keys are
        taken now)."""
        found = self._tier_keys(prompt_ids, lora_name, cache_salt)
        keys = [] if found is None else found[0][span[0] : span[1]]
        return functools.partial(self.tier.fetch, span[0], keys)

    def read_tier(self, prompt_ids: list[int], lora_name: str | None = None,
                  cache_salt: str | None = None) -> HostPages | None:
        """The prompt's pages the KV tier has past the pool's cached prefix, read now (offline
        callers; the rank loop reads on a thread)."""
        span = self.tier_span(prompt_ids, lora_name, cache_salt)
        return None if span is None else self.tier_reader(prompt_ids, lora_name, span,
                                                          cache_salt)()

    def _tier_keys(self, prompt_ids: list[int], lora_name: str | None, cache_salt: str | None
                   ) -> tuple[list[bytes], tuple[int, ...]] | None:
        """The tier's keys of the prompt's pages and its prefix-cache tokens (None: no tier, or an
        adapter that is not loaded, which add_request refuses)."""
        if self.tier is None:
            return None
        adapter = 0
        if lora_name is not None:
            found = None if self.lora is None else self.lora.by_name.get(lora_name)
            if found is None:
                return None
            adapter = found.id
        if not all(0 <= t < 1 << ADAPTER_SHIFT for t in prompt_ids):
            return None  # add_request refuses it
        tokens = cache_key_tokens(prompt_ids, adapter, salt_namespace(cache_salt))
        return self.tier.keys(tokens, self.tier_adapter_seeds()), tokens

    def tier_adapter_seeds(self) -> dict[int, bytes]:
        """The adapters served, id -> the hash of their files when served (the tier's keys of
        their pages; an adapter without one has none stored)."""
        if self.lora is None:
            return {}
        served = {a.id for a in self.lora.by_name.values()}
        return {i: seed for i, seed in self._adapter_seeds.items() if i in served}

    def _adapter_id(self, rid: str, name: str) -> int:
        adapter = None if self.lora is None else self.lora.by_name.get(name)
        if adapter is None:
            served = "no LoRA adapters" if self.lora is None else (
                "adapters " + ", ".join(map(repr, self.lora.by_name)) if self.lora.by_name
                else "no adapter yet")
            raise RequestRejected(f"request {rid!r}: no LoRA adapter named {name!r} is loaded "
                                  f"(this engine serves {served})")
        return adapter.id

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name`; AdapterError (a ValueError: nothing changed) when
        it cannot be served or LoRA is off."""
        self.serve_lora(name, path, self.read_lora(name, path))

    def read_lora(self, name: str, path: str) -> AdapterWeights:
        """The adapter at `path`, read and checked (changes nothing: a thread may read while the
        engine steps); AdapterError as `add_lora`."""
        if self.lora is None:
            raise AdapterError("LoRA is off: start the engine with enable_lora (--enable-lora)")
        return self.lora.read(name, path)

    def serve_lora(self, name: str, path: str, weights: AdapterWeights) -> None:
        """Serve weights from `read_lora` as `name` (AdapterError if the name was taken since)."""
        assert self.lora is not None, "weights read without LoRA"
        adapter = self.lora.serve(name, path, weights)
        self.seed_adapter(adapter.id, path)

    def seed_adapter(self, adapter_id: int, path: str) -> None:
        """The KV tier's seed of a served adapter's pages: its files as served (unreadable: its
        pages stay out of the tier)."""
        if self.tier is None:
            return
        try:
            self._adapter_seeds[adapter_id] = salt(adapter=files_identity(path))
        except OSError:
            self._adapter_seeds.pop(adapter_id, None)

    def lora_paths(self) -> dict[str, str]:
        """The adapters served: name -> path."""
        return {} if self.lora is None else {a.name: a.path for a in self.lora.by_name.values()}

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name`: False (nothing changed) while a request uses it; KeyError
        when no adapter has that name."""
        if self.lora is None or name not in self.lora.by_name:
            raise KeyError(name)
        if not self.scheduler.forget_adapter(self.lora.by_name[name].id):
            return False
        self.lora.remove(name)
        return True

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self._publish_cache_events()

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request early (a stop string matched on the detokenized text)."""
        self.scheduler.finish(rid, reason)
        self._publish_cache_events()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Plan and launch one step; commit the previous one (overlap) or this one. Returns the
        events."""
        plan = self.scheduler.schedule()
        if plan is not None and plan.draft_asks:
            plan = self.scheduler.add_drafts(plan, propose_drafts(plan))
        if self.keep_last_plan:
            self.last_plan = None if plan is None else dataclasses.replace(plan, members=())
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
        publisher and the KV tier, which copies out the pages it lacks. Called before a step's
        forward and between steps, never after a plan whose step may have written into a page
        stored since (a page cached and evicted again while planning keeps its bytes until the
        forward of the step that took it)."""
        cache = self.scheduler.cache
        events, cache.events = cache.events, []
        stored = self.tier.save(events) if self.tier is not None and events else []
        if self.kv_events is None:
            return
        if events:
            self.kv_events.publish(events)
        if self.tier is not None:
            self._publish_disk(stored)

    def _publish_disk(self, stored: list[tuple[CacheStored, list[bytes]]]) -> None:
        """KV events for the tier's pages (medium "DISK"): those just queued for the disk, and
        those the store removed (known by their blocks' hashes while this process runs)."""
        from compiled_engine.kv_events.publisher import DISK, chain_hashes, external

        ps = self.config.page_size
        for ev, keys in stored:
            first = ev.start // ps
            for key, digest in zip(keys, chain_hashes(ev.path, ps)[first:], strict=True):
                self._disk_blocks[key] = external(digest)
        if stored:
            self.kv_events.publish([ev for ev, _ in stored], DISK)
        gone = [self._disk_blocks.pop(k) for k in self.tier.store.take_removed()
                if k in self._disk_blocks]
        if gone:
            self.kv_events.publish(gone, DISK)

    def shutdown(self) -> None:
        self._publish_cache_events()  # what the last commits cached (no plan since)
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.tier is not None:
            self.tier.shutdown()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        # `startup.build_engine` froze the engine's objects: they may be collected again
        gc.unfreeze()

    def _launch(self, plan: StepPlan) -> _Launched:
        """The sampler's rows (token masks included) and the prompt rows to keep, then the forward.
        Under overlap the previous step's forward runs meanwhile."""
        self._publish_cache_events()  # what planning cached, before the forward can overwrite it
        if plan.adapter_loads:
            # no step in flight reads these slots (the ledger's AdapterSlots)
            assert self.lora is not None, "adapter loads without LoRA"
            self.lora.load_slots(plan.adapter_loads)
        if plan.tier_loads:
            self._load_host_pages(plan)
        sampling: list[SamplingRow] = []
        kept: list[tuple[KeptRows, RequestState]] = []
        for i, (step, req) in enumerate(zip(plan.reqs, plan.members, strict=True)):
            state: RequestState = req.hooks
            if step.sample:
                state.add_sampling_rows(step, len(req.prompt), sampling)
            if state.prompt is not None:
                rows = state.kept_rows(step, i, req)
                if rows is not None:
                    kept.append((rows, state))
        rows = [k for k, _ in kept]
        if not self._overlap or self.runner.asynchronous:
            pending = self.runner.launch(plan, sampling, rows)
        else:
            # a synchronous device computes in its launch: overlap runs it on a thread
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, "forward")
            pending = self._worker.submit(self.runner.execute, plan, sampling, rows)
        return _Launched(plan, pending, kept)

    def _load_host_pages(self, plan: StepPlan) -> None:
        """Write the prompt pages requests hold on the host into the pages the plan gave them (no
        step in flight touches those)."""
        assert self.tier is not None, "tier loads without a tier"
        members = {req.rid: req for req in plan.members}
        for load in plan.tier_loads:
            state: RequestState = members[load.rid].hooks
            host = state.host_kv
            at = load.first - host.first
            self.tier.load(load.pages, host.kv[at : at + len(load.pages)])
            state.host_kv = None  # loaded once (`Request.host_loaded`)

    def _commit(self, launched: _Launched, output: StepOutput) -> list[TokenEvent]:
        """Hand each kept prompt chunk's log-probs and hidden states to its request's record; the
        scheduler's commit does the rest."""
        logprobs = iter(output.prompt_logprobs or [])
        hidden = iter(output.hidden or [])
        for rows, state in launched.kept:
            step = launched.plan.reqs[rows.index]
            chunk = [next(logprobs) for _ in range(rows.num_logprobs)]
            states = next(hidden) if rows.hidden else None
            if state.prompt is not None:  # None: an earlier step's first event carried it
                state.prompt.add(step, chunk, states)
        return self.scheduler.commit(launched.plan, output)
