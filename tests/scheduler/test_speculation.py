"""Speculative decoding in the ledger, example by example: the paths the property machine reaches
only now and then (a request retracted while its verify step is in flight), and the policy."""

from __future__ import annotations

import collections

import pytest

from compiled_engine.scheduler import DraftAsk, LedgerParams, Scheduler, SchedulerConfig, SpecConfig
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Proposer,
    plan_step,
    reference_output,
    run_to_completion,
)

VOCAB = 16


class Oracle:
    """Drafts from the fake model's own greedy output: `right` correct tokens, then wrong ones."""

    def __init__(self, right: int = 99) -> None:
        self.right = right
        self.refs: dict[str, list[int]] = {}
        self.calls: list[str] = []
        self.silent: set[str] = set()  # requests that draft nothing

    def expect(self, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
        self.refs[rid] = reference_output(
            prompt, len(prompt) + max_tokens, frozenset(), 0, VOCAB
        )
        return self.refs[rid]

    def __call__(self, req, k: int) -> tuple[int, ...]:
        self.calls.append(req.rid)
        if req.rid in self.silent:
            return ()
        ref = self.refs[req.rid][len(req.output) :] + [0] * k
        return tuple(ref[i] if i < self.right else (ref[i] + 1) % VOCAB for i in range(k))


def make(**kw) -> tuple[Scheduler, FakeExecutor]:
    spec = kw.pop("spec", SpecConfig(3))
    cfg = SchedulerConfig(
        **{"num_pages": 64, "max_running": 8, "max_context": 64, "speculative": spec, **kw}
    )
    return Scheduler(cfg), FakeExecutor(cfg, vocab_size=VOCAB)


def run(sched: Scheduler, exe: FakeExecutor, propose: Proposer) -> tuple[list, list[int]]:
    """Steps until idle (no overlap): the events, and the drafts each step carried."""
    events, drafted = [], []
    while sched.has_work():
        plan = plan_step(sched, propose)
        drafted.append(sum(len(rs.draft) for rs in plan.reqs))
        events += sched.commit(plan, exe.execute(plan))
        exe.retire(plan.step)
    return events, drafted


def tokens_of(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ev in events:
        if ev.token is not None:
            out.setdefault(ev.rid, []).append(ev.token)
    return out


def test_accepted_drafts_give_the_same_tokens_in_fewer_steps() -> None:
    oracle = Oracle()
    sched, exe = make()
    ref = oracle.expect("a", [3, 4, 5], 12)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=12, ignore_eos=True))
    events, drafted = run(sched, exe, oracle)
    assert tokens_of(events)["a"] == ref
    # the prompt's step, then 11 tokens at up to 4 a step: max_len leaves room for 2 drafts last
    assert drafted == [0, 3, 3, 2]
    assert sched.spec.num_accepted_tokens == 8
    sched.check_integrity()


def test_rejected_drafts_give_back_their_pages() -> None:
    oracle = Oracle(right=1)
    sched, exe = make(page_size=2, spec=SpecConfig(4, min_acceptance=0.0))
    ref = oracle.expect("a", [3, 4, 5], 9)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=9, ignore_eos=True))
    free = sched.allocator.num_free
    plan = plan_step(sched, oracle)
    sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    plan = plan_step(sched, oracle)
    (rs,) = plan.reqs
    assert rs.draft and rs.length == 5  # the last token and 4 drafts: 8 positions, 4 pages
    req = sched.get_request("a")
    assert len(req.pages) == 4
    events = sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    assert [ev.token for ev in events] == ref[1:3]  # one draft accepted, then the target's token
    assert req.planned_len == 5 and len(req.pages) == 3  # positions 5..7 given back: one page
    assert sched.allocator.num_free == free - 3
    sched.check_integrity()
    assert tokens_of(run_to_completion(sched, exe, propose=oracle))["a"] == ref[3:]
    sched.check_integrity()


def test_the_prefix_cache_never_holds_a_draft() -> None:
    """A finished request's rejected drafts were computed into its pages; a later request whose
    prompt continues the real tokens reads only real KV (the executor checks every slot)."""
    oracle = Oracle(right=0)
    sched, exe = make(spec=SpecConfig(3, min_acceptance=0.0))
    ref = oracle.expect("a", [3, 4, 5], 6)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=6, ignore_eos=True))
    assert tokens_of(run_to_completion(sched, exe, propose=oracle))["a"] == ref
    assert sched.spec.num_draft_tokens and not sched.spec.num_accepted_tokens
    prompt = [3, 4, 5, *ref, 7]
    ref_b = oracle.expect("b", prompt, 2)
    sched.add_request("b", prompt, LedgerParams(max_tokens=2, ignore_eos=True))
    assert tokens_of(run_to_completion(sched, exe, propose=oracle))["b"] == ref_b
    assert sched.cache.hit_rate > 0.5  # it did read the first request's pages
    sched.check_integrity()


def test_no_request_is_retracted_while_a_verify_step_is_in_flight() -> None:
    """Overlap: `a`'s verify step is in flight and the pool is full when `b` needs a page: `b` waits
    for that commit (the pages of `a`'s rejected drafts may come back) instead of retracting `a`
    mid-verify; everyone's output is unchanged."""
    oracle = Oracle()
    sched, exe = make(num_pages=10, max_running=2, spec=SpecConfig(3))
    # the pool caps each request at 9 usable slots + 1: 7 generated tokens
    refs = {rid: oracle.expect(rid, [2, 3, i], 7) for i, rid in ((5, "b"), (6, "a"))}
    sched.add_request("b", [2, 3, 5], LedgerParams(max_tokens=8, ignore_eos=True))
    # b does not speculate (as after a window of low acceptance): it decodes under overlap
    sched.get_request("b").spec.paused_until = 1 << 30
    sched.add_request("a", [2, 3, 6], LedgerParams(max_tokens=8, ignore_eos=True))
    events = []
    plan = plan_step(sched, oracle)  # both prompts
    events += sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    plan = plan_step(sched, oracle)  # b decodes, a verifies 3 drafts: the pool is full
    # (the prompts share 2 pages)
    assert [len(rs.draft) for rs in plan.reqs] == [0, 3] and sched.allocator.num_free == 0
    launched = (plan, exe.execute(plan))
    assert plan_step(sched, oracle) is None  # b waits: nothing is retracted
    a = sched.get_request("a")
    assert a.pages and sched.num_retractions == 0
    events += sched.commit(*launched)
    exe.retire(plan.step)
    events += run_to_completion(sched, exe, lag=1, propose=oracle)
    assert tokens_of(events) == refs


def test_low_acceptance_pauses_speculation_then_retries() -> None:
    oracle = Oracle(right=0)
    spec = SpecConfig(2, min_acceptance=0.5, window=4, retry_after=3)
    sched, exe = make(spec=spec)
    ref = oracle.expect("a", [3, 4, 5], 20)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=20, ignore_eos=True))
    events, drafted = run(sched, exe, oracle)
    assert tokens_of(events)["a"] == ref
    # the prompt's step; verify steps of 2, then 1, 1 drafts (none accepted: shorter drafts) fill
    # the window of 4: 3 plain decodes, then drafting again (1 token: nothing was accepted since)
    assert drafted[:9] == [0, 2, 1, 1, 0, 0, 0, 1, 1]


def test_draft_length_follows_what_is_accepted() -> None:
    """k at first; then about twice the recent accepted drafts: 1 accepted a step -> 2 drafted."""
    oracle = Oracle(right=1)
    sched, exe = make(spec=SpecConfig(6, min_acceptance=0.0))
    ref = oracle.expect("a", [3, 4, 5], 16)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=16, ignore_eos=True))
    events, drafted = run(sched, exe, oracle)
    assert tokens_of(events)["a"] == ref
    assert drafted[:5] == [0, 6, 2, 2, 2]
    oracle.right = 99
    ref = oracle.expect("b", [3, 4, 6], 24)
    sched.add_request("b", [3, 4, 6], LedgerParams(max_tokens=24, ignore_eos=True))
    events, drafted = run(sched, exe, oracle)
    assert tokens_of(events)["b"] == ref
    assert drafted[:4] == [0, 6, 6, 6]  # every draft accepted: k each step


def test_above_max_batch_only_requests_that_copy_draft() -> None:
    """max_batch 2: while two run, both draft; `copy` has all its drafts accepted, `free` none. Once
    a third runs, only `copy` drafts, and `x` (never measured) does not either."""
    oracle = Oracle()
    refs = {rid: oracle.expect(rid, [3, 4, i], 16) for i, rid in enumerate(("copy", "free", "x"))}
    wrong = {"free", "x"}
    right = Oracle.__call__

    def propose(req, k):
        ref = oracle.refs[req.rid][len(req.output) :] + [0] * k
        if sched.num_running == 3:
            oracle.calls.append(req.rid)
        if req.rid in wrong:
            return tuple((t + 1) % VOCAB for t in ref[:k])
        return right(oracle, req, k)

    sched, exe = make(spec=SpecConfig(4, max_batch=2, copy_accepted=2.0,
                                               min_acceptance=0.0))
    events = []
    for i, rid in enumerate(refs):
        sched.add_request(rid, [3, 4, i], LedgerParams(max_tokens=16, ignore_eos=True))
        for _ in range(2 if rid != "x" else 0):  # two steps before the next arrives
            plan = plan_step(sched, propose)
            events += sched.commit(plan, exe.execute(plan))
            exe.retire(plan.step)
    more, _ = run(sched, exe, propose)
    assert tokens_of(events + more) == refs
    calls = collections.Counter(oracle.calls)
    assert calls["free"] == calls["x"] == 0 and calls["copy"] >= 1, calls


def test_a_small_batch_drafts_whatever_was_accepted() -> None:
    oracle = Oracle(right=0)
    sched, exe = make(spec=SpecConfig(2, max_batch=2, min_acceptance=0.0))
    for i in range(2):
        oracle.expect(f"r{i}", [3, 4, i], 6)
        sched.add_request(f"r{i}", [3, 4, i], LedgerParams(max_tokens=6, ignore_eos=True))
    events = run_to_completion(sched, exe, propose=oracle)
    assert tokens_of(events) == oracle.refs
    # every decode step drafted but the last (no room under max_len for a draft and the bonus)
    assert collections.Counter(oracle.calls) == {"r0": 4, "r1": 4}


def test_overlap_waits_for_a_verify_step_in_flight() -> None:
    """Two requests verify (a batch of 2) in the step that admits a third, so the batch rule stops
    their drafting. Planned again before their verify step commits they would assume every draft
    accepted: they wait for the commit instead (the executor checks every slot they read)."""
    oracle = Oracle(right=0)
    sched, exe = make(spec=SpecConfig(3, max_batch=2, min_acceptance=0.0))
    refs = {rid: oracle.expect(rid, [3, 4, i], 10) for i, rid in enumerate("abc")}
    for rid in "ab":
        sched.add_request(rid, [3, 4, "abc".index(rid)], LedgerParams(max_tokens=10,
                                                                       ignore_eos=True))
    plan = plan_step(sched, oracle)
    events = sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    sched.add_request("c", [3, 4, 2], LedgerParams(max_tokens=10, ignore_eos=True))
    verify = plan_step(sched, oracle)
    assert [(rs.rid, len(rs.draft)) for rs in verify.reqs] == [("a", 3), ("b", 3), ("c", 0)]
    launched = (verify, exe.execute(verify))
    nxt = plan_step(sched, oracle)
    assert nxt is not None and [rs.rid for rs in nxt.reqs] == ["c"]
    events += sched.commit(*launched)
    exe.retire(verify.step)
    events += sched.commit(nxt, exe.execute(nxt))
    exe.retire(nxt.step)
    events += run_to_completion(sched, exe, lag=1, propose=oracle)
    assert tokens_of(events) == refs
    sched.check_integrity()


def test_drafts_never_take_the_page_another_decode_needs() -> None:
    """Three free pages: `a`'s decode takes one, `b`'s decode needs one; `a` drafts into what is
    left beyond that (one page: too few for its 3 drafts, so none), and nobody is retracted."""
    oracle = Oracle()
    sched, exe = make(num_pages=10, spec=SpecConfig(3))
    refs = {rid: oracle.expect(rid, [i, 9, 9], 4) for i, rid in ((5, "a"), (6, "b"))}
    for i, rid in ((5, "a"), (6, "b")):
        sched.add_request(rid, [i, 9, 9], LedgerParams(max_tokens=4, ignore_eos=True))
    plan = plan_step(sched, oracle)
    events = sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    assert sched.allocator.num_free == 3
    plan = plan_step(sched, oracle)
    assert [(rs.rid, len(rs.draft)) for rs in plan.reqs] == [("a", 0), ("b", 0)]
    assert sched.num_retractions == 0
    events += sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    assert tokens_of(events) == {rid: ref[:2] for rid, ref in refs.items()}
    sched.check_integrity()


def test_overlap_a_request_with_nothing_to_draft_does_not_wait() -> None:
    """Overlap: a drafting request waits a step for its token in flight before it proposes; when
    its proposals come back empty it decodes without waiting (probing again every `empty_retry`
    steps), so it takes about as many steps as with no speculation at all."""

    def steps(spec: SpecConfig | None) -> int:
        oracle = Oracle()
        oracle.silent.add("a")
        sched, exe = make(spec=spec)
        oracle.expect("a", [3, 4, 5], 40)
        sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=40, ignore_eos=True))
        events = run_to_completion(sched, exe, lag=1, propose=oracle)
        assert tokens_of(events) == oracle.refs
        return exe.steps

    plain, spec = steps(None), steps(SpecConfig(4, empty_retry=4))
    assert plain <= spec <= plain * 1.25, (plain, spec)


def test_overlap_no_retraction_while_rejected_drafts_hold_pages() -> None:
    """Overlap: `a`'s drafts (all wrong) hold pages while its verify step is in flight; `b`'s decode
    waits for them to come back at that commit instead of retracting anyone."""

    def retractions(spec: SpecConfig | None) -> int:
        oracle = Oracle(right=0)
        sched, exe = make(num_pages=14, spec=spec)
        for rid, prompt in (("a", [3, 4, 5]), ("b", [6, 7, 8])):
            oracle.expect(rid, prompt, 10)
            sched.add_request(rid, prompt, LedgerParams(max_tokens=10, ignore_eos=True))
        sched.get_request("b").spec.paused_until = 1 << 30  # b decodes plainly
        events = run_to_completion(sched, exe, lag=1, propose=oracle)
        assert tokens_of(events) == oracle.refs
        return sched.num_retractions

    assert retractions(SpecConfig(4, min_acceptance=0.0)) == retractions(None)


def test_a_plan_asks_for_drafts_and_takes_their_pages_first() -> None:
    """The scheduler never calls a proposer: its plan asks for up to k drafts with their pages
    taken (a draft model writes its KV there); `add_drafts` puts in what was proposed and gives
    back the pages past it at once."""
    oracle = Oracle()
    sched, exe = make(page_size=2, spec=SpecConfig(4, min_acceptance=0.0))
    ref = oracle.expect("a", [3, 4, 5], 9)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=9, ignore_eos=True))
    plan = plan_step(sched, oracle)
    sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    free = sched.allocator.num_free
    asking = sched.schedule()
    assert asking.draft_asks == (DraftAsk(0, 4),) and asking.reqs[0].length == 1
    req = sched.get_request("a")
    assert len(req.pages) == 4 and sched.allocator.num_free == free - 2  # positions 3..7
    sched.check_integrity()
    plan = sched.add_drafts(asking, [tuple(ref[1:3])])
    (rs,) = plan.reqs
    assert rs.draft == tuple(ref[1:3]) and rs.length == 3 and not plan.draft_asks
    assert len(req.pages) == 3 and sched.allocator.num_free == free - 1  # positions 3..5 kept
    output = exe.execute(plan)
    with pytest.raises(ValueError, match="out of order"):
        sched.commit(asking, output)  # the plan in flight is the one with drafts
    events = sched.commit(plan, output)
    exe.retire(plan.step)
    assert [ev.token for ev in events] == ref[1:4]  # both drafts and the bonus token
    assert tokens_of(run_to_completion(sched, exe, propose=oracle))["a"] == ref[4:]
    sched.check_integrity()


def test_only_the_latest_plan_takes_drafts() -> None:
    oracle = Oracle()
    sched, exe = make(spec=SpecConfig(3))
    oracle.expect("a", [3, 4, 5], 9)
    sched.add_request("a", [3, 4, 5], LedgerParams(max_tokens=9, ignore_eos=True))
    plan = sched.schedule()
    sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    asking = sched.schedule()
    with pytest.raises(ValueError, match="1 draft asks"):
        sched.add_drafts(asking, [])
    sched.add_drafts(asking, [()])  # nothing proposed: a plain decode, its pages given back
    with pytest.raises(ValueError, match="only the latest plan"):
        sched.add_drafts(asking, [()])
    sched.check_integrity()
