"""The whole scheduler driven by the fake executor: tiny pools, shared prefixes, abort, overlap,
speculative decoding (a proposer whose drafts a rule makes right, right for j tokens then wrong,
all wrong, or absent).

After every rule the ledger invariants hold; every emitted token is the fake model's greedy token
for that request run alone; finished requests end exactly as the model run alone would. Every step
admits from the head of the waiting queue only (FIFO: no request is overtaken) and keeps within its
token budget. Hypothesis is steered (`target`) towards retraction, eviction, deduplication of a
shared prefix, the shared-prefix wait, accepted and rejected drafts, and the run asserts that each
of them was reached and prints how often.
"""

import collections
import functools
from collections import deque

import pytest
from hypothesis import event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from compiled_engine.scheduler import (
    LedgerParams,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    SpecConfig,
    Status,
    StepPlan,
)
from compiled_engine.scheduler.prefix_cache import CacheStored
from compiled_engine.scheduler.priority import rank
from compiled_engine.scheduler.request import ADAPTER_SHIFT
from tests.scheduler.fake_executor import FakeExecutor, mix, reference_output

VOCAB = 12
EOS = (0, 1)
PATHS = ("retraction", "eviction", "dedup", "prefix wait", "draft accepted", "draft rejected",
         "adapter reload", "tier load", "preemption")
DRAFT_MODES = ("right", "partial", "wrong", "none")
REACHED: collections.Counter[str] = collections.Counter()  # examples that reached each path


def guarded(f):
    """Mark the machine broken when a rule fails, so that teardown does not mask the failure."""

    @functools.wraps(f)
    def wrapper(self, *args, **kwargs):
        try:
            return f(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper


request_args = st.fixed_dictionaries(
    {
        "base": st.integers(0, 1),
        # whole shared bases often: prefix sharing
        "keep": st.one_of(st.just(8), st.integers(0, 8)),
        "suffix": st.lists(st.integers(0, VOCAB - 1), max_size=4),
        "max_tokens": st.integers(0, 8),
        "min_tokens": st.integers(0, 2),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.integers(0, VOCAB - 1), max_size=1),
        # LoRA: 0 the base model, else an adapter (more of them than the machine has slots)
        "adapter": st.sampled_from([0, 0, 1, 2, 3]),
        # the KV tier: prompt pages [first, end) the engine read from the tier (whole pages only)
        # priority scheduling (lower is sooner; ignored under fcfs)
        "priority": st.sampled_from([0, 0, 1, 2, -1]),
        # (mostly none: pages from the tier skip prefills that the "prefix wait" path needs)
        "host_pages": st.one_of(st.just((0, 0)), st.just((0, 0)), st.just((0, 0)),
                                st.tuples(st.integers(0, 2), st.integers(0, 6))
                                .map(lambda fe: (fe[0], max(fe)))),
    }
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 3]),
        num_pages=st.integers(3, 14),
        max_running=st.integers(1, 4),
        max_context=st.integers(3, 24),
        # (large ones let a second request see a first one's whole prompt pending: prefix wait)
        chunk_budget=st.sampled_from([1, 2, 3, 5, 8, 12, 16, 24]),
        mixed=st.booleans(),
        prefix_cache=st.sampled_from(["radix", "naive"]),
        lag=st.sampled_from([0, 1]),
        share_wait=st.sampled_from([1, 2, 3, 32]),
        spec_k=st.sampled_from([0, 0, 1, 2, 4]),
        spec_window=st.integers(1, 4),
        spec_batch=st.sampled_from([1, 2, 4]),
        max_loras=st.sampled_from([0, 1, 2]),
        policy=st.sampled_from(["fcfs", "priority"]),
        aging_steps=st.sampled_from([1, 3, 64]),
        bases=st.lists(
            st.lists(st.integers(2, VOCAB - 1), min_size=8, max_size=8), min_size=2, max_size=2
        ),
    )
    def setup(
        self,
        page_size,
        num_pages,
        max_running,
        max_context,
        chunk_budget,
        mixed,
        prefix_cache,
        lag,
        share_wait,
        spec_k,
        spec_window,
        spec_batch,
        max_loras,
        policy,
        aging_steps,
        bases,
    ):
        self.cfg = SchedulerConfig(
            num_pages=num_pages,
            page_size=page_size,
            max_running=max_running,
            max_context=max_context,
            chunk_budget=chunk_budget,
            mixed=mixed,
            prefix_cache=prefix_cache,
            eos_token_ids=EOS,
            share_wait_tokens=share_wait,
            speculative=SpecConfig(spec_k, min_acceptance=0.5, window=spec_window, retry_after=2,
                                   max_batch=spec_batch, copy_accepted=1.0)
            if spec_k
            else None,
            max_loras=max_loras,
            policy=policy,
            aging_steps=aging_steps,
        )
        self.sched = Scheduler(self.cfg)
        self.sched.cache.events = []  # what the KV tier would copy out (`stored_pages_hold_kv`)
        self.draft_mode, self.draft_right = "right", 0

        self.exe = FakeExecutor(self.cfg, vocab_size=VOCAB)
        self.lag = lag
        self.bases = bases
        self.pending: deque[tuple[StepPlan, list[int]]] = deque()
        self.expected: dict[str, list[int]] = {}  # rid -> reference output
        self.outputs: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}  # finished through an event
        self.cut: set[str] = set()  # aborted or finished through the hook: output is a prefix only
        self.stop_ids: dict[str, frozenset[int]] = {}
        self.min_tokens: dict[str, int] = {}
        self.live: list[str] = []
        self.count = 0

    # -- inputs ----------------------------------------------------------------------------------

    @rule(reqs=st.lists(request_args, min_size=2, max_size=4))
    @guarded
    def add_many(self, reqs):
        for args in reqs:
            self.add(**args)

    @rule(args=request_args)
    @guarded
    def add_one(self, args):
        self.add(**args)

    def add(self, base, keep, suffix, max_tokens, min_tokens, ignore_eos, stop, adapter,
            host_pages, priority):
        rid = f"r{self.count}"
        self.count += 1
        if self.cfg.policy == "fcfs":
            priority = 0  # refused there (tests/scheduler/test_priority.py)
        prompt = self.bases[base][:keep] + suffix
        sp = LedgerParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=tuple(stop),
            adapter=adapter,
            host_pages=host_pages,
            priority=priority,
        )
        cap = self.cfg.capacity_tokens
        if (not prompt or len(prompt) >= self.cfg.max_context or len(prompt) + 1 > cap
                or (adapter and not self.cfg.max_loras)):
            with pytest.raises(RequestRejected):
                self.sched.add_request(rid, prompt, sp)
            return
        self.sched.add_request(rid, prompt, sp)
        stop_ids = frozenset(stop) if ignore_eos else frozenset(stop) | frozenset(EOS)
        max_len = min(len(prompt) + max_tokens, self.cfg.max_context, cap + 1)
        self.expected[rid] = reference_output(prompt, max_len, stop_ids, sp.min_tokens, VOCAB,
                                              adapter)
        self.stop_ids[rid] = stop_ids
        self.min_tokens[rid] = sp.min_tokens
        self.outputs[rid] = []
        self.live.append(rid)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), hook=st.booleans())
    @guarded
    def abort(self, i, hook):
        rid = self.live.pop(i % len(self.live))
        if hook:
            self.sched.finish(rid, "stop")
        else:
            self.sched.abort(rid)
        self.cut.add(rid)
        self.sched.abort(rid)  # a second abort is a no-op

    @rule()
    @guarded
    def abort_unknown(self):
        self.sched.abort("no-such-request")

    @rule(mode=st.sampled_from(DRAFT_MODES), right=st.integers(0, 3))
    @guarded
    def drafts(self, mode, right):
        """How the proposer drafts from now on: the reference's next tokens, `right` of them then
        wrong ones, wrong ones only, or nothing."""
        self.draft_mode, self.draft_right = mode, right

    def propose(self, req, k: int) -> tuple[int, ...]:
        ref = self.expected[req.rid][len(req.output) :]
        ref = ref + [(len(ref) + i) % VOCAB for i in range(k)]  # past the end: any token
        n_right = {"right": k, "partial": self.draft_right, "wrong": 0, "none": 0}[self.draft_mode]
        if self.draft_mode == "none":
            return ()
        return tuple(ref[i] if i < n_right else (ref[i] + 1) % VOCAB for i in range(k))

    # -- steps -----------------------------------------------------------------------------------

    @rule(n=st.integers(1, 4))
    @guarded
    def steps(self, n):
        for _ in range(n):
            self.step()

    def step(self):
        batch = self.plan() if len(self.pending) <= self.lag else None
        if batch is not None:
            self.stored_pages_hold_kv()  # the engine copies them out here, before the forward
            self.pending.append((batch, self.exe.execute(batch)))
        if self.pending and (batch is None or len(self.pending) > self.lag):
            self.commit()
        elif batch is None:
            assert not self.sched.has_work(), (
                "stalled: work left, nothing planned, nothing in flight"
            )
        self.sched.check_integrity()

    def stored_pages_hold_kv(self) -> None:
        """Every page the prefix cache stored since the last forward still holds the KV of its
        tokens (cached and evicted again while planning, it may already belong to another
        request, which writes it only in its step's forward): what the KV tier copies out at each
        launch and between steps is what its key names."""
        ps = self.cfg.page_size
        for ev in self.sched.cache.events:
            if not isinstance(ev, CacheStored):
                continue
            adapter = ev.path[0] >> ADAPTER_SHIFT if ev.path else 0
            tokens = [t & ((1 << ADAPTER_SHIFT) - 1) for t in ev.path]
            h = 0
            for q, tok in enumerate(tokens):
                h = mix(h, tok, q, adapter)
                if q >= ev.start:
                    slot = ev.pages[(q - ev.start) // ps] * ps + q % ps
                    assert self.exe.kv[slot] == (q, tok, h), (
                        f"page {ev.pages[(q - ev.start) // ps]}, stored for position {q}, holds "
                        "other KV before the forward")
        self.sched.cache.events.clear()

    def plan(self) -> StepPlan | None:
        """schedule(), checking that it admitted a prefix of the waiting queue and kept its
        budget."""
        before = [r.rid for r in self.sched.waiting]
        batch = self.sched.schedule()
        if batch is not None and batch.draft_asks:
            self.sched.check_integrity()  # the drafts' pages taken, none proposed yet
            batch = self.sched.add_drafts(batch, [
                self.propose(batch.members[a.index], a.k) for a in batch.draft_asks
            ])
        still = {r.rid for r in self.sched.waiting}
        admitted = [rid for rid in before if rid not in still]
        if self.cfg.policy == "fcfs":
            assert admitted == before[: len(admitted)], (
                f"admission overtook the queue: {before} -> admitted {admitted}"
            )
        elif batch is not None and admitted:  # by rank: none left waiting ranks before them
            aging = self.cfg.aging_steps
            worst_in = max(rank(self.sched.get_request(rid), batch.step, aging) for rid in admitted)
            best_out = min((rank(r, batch.step, aging) for r in self.sched.waiting),
                           default=None)
            assert best_out is None or worst_in < best_out, (
                f"admission overtook a better rank: admitted {admitted}, waiting "
                f"{[r.rid for r in self.sched.waiting]}"
            )
        if batch is not None:
            assert len(batch.reqs) <= self.cfg.max_running, (
                "more requests in a step than max_running"
            )
            chunks = [rs for rs in batch.reqs if rs.start < self.sched.get_request(rs.rid).fill_to]
            prefill = sum(rs.length for rs in chunks)
            decodes = sum(rs.length for rs in batch.reqs) - prefill
            if self.cfg.mixed:
                assert sum(rs.length for rs in batch.reqs) <= max(
                    self.cfg.chunk_budget, len(batch.reqs)
                ), "drafts over the token budget"
            if self.cfg.mixed:
                assert prefill <= max(0, self.cfg.chunk_budget - decodes), (
                    f"prefill {prefill} over the budget"
                )
            else:
                assert prefill <= self.cfg.chunk_budget and not (prefill and decodes), (
                    "a mixed or oversized step"
                )
        return batch

    @precondition(lambda self: self.pending)
    @rule()
    @guarded
    def commit(self):
        batch, tokens = self.pending.popleft()
        mid_verify = [rs.rid for rs in batch.reqs if rs.draft and (r := self.sched.get_request(
            rs.rid)) is not None and r.status is not Status.RUNNING]
        assert not mid_verify, f"{mid_verify}: retracted while a verify step was in flight"
        for ev in self.sched.commit(batch, tokens):
            assert ev.rid not in self.reasons, f"{ev.rid}: event after its finish"
            assert ev.rid not in self.cut, f"{ev.rid}: event after abort / finish hook"
            if ev.token is not None:
                out = self.outputs[ev.rid]
                out.append(ev.token)
                assert out == self.expected[ev.rid][: len(out)], (
                    f"{ev.rid}: {out} vs {self.expected[ev.rid]}"
                )
            if ev.finished:
                self.reasons[ev.rid] = ev.finish_reason
                self.live.remove(ev.rid)
        self.exe.retire(batch.step)

    @rule()
    @guarded
    def drain(self):
        limit = 100 * (len(self.live) + 1)  # generous: every request fits alone in under 100 steps
        for _ in range(limit):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work(), f"no progress after {limit} steps"
        for rid, ref in self.expected.items():
            if rid in self.cut:
                continue
            assert rid in self.reasons, f"{rid} never finished"
            assert self.outputs[rid] == ref, f"{rid}: {self.outputs[rid]} vs reference {ref}"
            stopped = (
                bool(ref) and ref[-1] in self.stop_ids[rid] and len(ref) > self.min_tokens[rid]
            )
            assert self.reasons[rid] == ("stop" if stopped else "length"), (
                f"{rid}: {self.reasons[rid]}"
            )

    @invariant()
    @guarded
    def ledger(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self):
        if hasattr(self, "sched") and not getattr(self, "broken", False):
            self.drain()
            self.sched.check_integrity()
            counts = {
                "retraction": self.sched.num_retractions,
                "eviction": self.sched.cache.num_evicted_pages,
                "dedup": self.sched.book.num_dedup_pages,
                "adapter reload": self.sched.book.adapters.num_loads
                - len(self.sched.book.adapters.by_adapter),
                "tier load": self.sched.book.tier_hit_tokens,
                "preemption": self.sched.num_preemptions,
                "prefix wait": self.sched.num_prefix_waits,
                "draft accepted": self.sched.spec.num_accepted_tokens,
                "draft rejected": self.sched.spec.num_draft_tokens
                - self.sched.spec.num_accepted_tokens,
            }
            for path, count in counts.items():
                target(float(count), label=path)
                if count:
                    event(path)
                    REACHED[path] += 1


def test_scheduler_machine_reaches_every_path() -> None:
    """Derandomized: the same examples every run, so that reaching the rare paths (prefix wait)
    does not depend on the run's seed; `--hypothesis-profile=deep` explores more of them."""
    REACHED.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(derandomize=True))
    print("scheduler machine: examples reaching each path:", dict(REACHED))
    assert all(REACHED[path] for path in PATHS), f"paths never reached: {dict(REACHED)}"
