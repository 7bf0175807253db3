"""The commit is the one place a step's output becomes events: a sampler error or a token the
request's hooks reject fails that request only (its token dropped), hooks end a complete document,
log-probs are cut to what each request asked, and the first event carries its first-event fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from compiled_engine.scheduler import (
    LedgerParams,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    TokenRejected,
)
from tests.scheduler.fake_executor import FakeExecutor

CFG = SchedulerConfig(num_pages=32, page_size=2, max_running=4, max_context=32)


@dataclass
class Hooks:
    """A request's hooks: rejects `reject`, completes at `complete`, counts first_event calls."""

    logprobs: int | None = None
    reject: int | None = None
    complete: int | None = None
    seen: list[int] = field(default_factory=list)
    firsts: int = 0

    def on_token(self, token: int) -> bool:
        if token == self.reject:
            raise TokenRejected(f"token {token} is not allowed")
        self.seen.append(token)
        return token == self.complete

    def first_event(self) -> dict[str, object]:
        self.firsts += 1
        return {"embedding": [float(self.firsts)]}


def _run(sched: Scheduler, outputs) -> list:
    """Steps until idle; `outputs(plan, executed)` makes each step's StepOutput."""
    exe = FakeExecutor(CFG)
    events = []
    for _ in range(100):
        if not sched.has_work():
            return events
        plan = sched.schedule()
        events += sched.commit(plan, outputs(plan, exe.execute(plan)))
        exe.retire(plan.step)
        sched.check_integrity()
    raise AssertionError("the scheduler did not finish")


def _by_rid(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for ev in events:
        out.setdefault(ev.rid, []).append(ev)
    return out


def _add(sched: Scheduler, rid: str, hooks: Hooks | None, constrained: bool = False) -> None:
    params = LedgerParams(max_tokens=6, ignore_eos=True, constrained=constrained)
    sched.add_request(rid, [1, 2, len(rid)], params, hooks)


def test_a_sampler_error_fails_its_request_only() -> None:
    sched = Scheduler(CFG)
    for rid in ("a", "bb", "ccc"):
        _add(sched, rid, None)
    alone = _by_rid(_run(sched, _same))

    sched = Scheduler(CFG)
    for rid in ("a", "bb", "ccc"):
        _add(sched, rid, None)

    def fail_bb_at_step_3(plan, out: StepOutput) -> StepOutput:
        if plan.step == 3:
            rows = [rs.rid for rs in plan.reqs for _ in range(rs.num_sampled)]
            out.errors = {rows.index("bb"): "a logits processor raised"}
        return out

    events = _by_rid(_run(sched, fail_bb_at_step_3))
    assert events["a"] == alone["a"] and events["ccc"] == alone["ccc"]
    bb = events["bb"]
    assert bb[:-1] == alone["bb"][: len(bb) - 1]
    assert (bb[-1].token, bb[-1].finish_reason, bb[-1].error) == (
        None, "error", "a logits processor raised"
    )


def _tokens(rids: tuple[str, ...]) -> dict[str, list[int]]:
    """Each request's tokens without hooks (the fake model's: a request's own, whatever its
    batch)."""
    sched = Scheduler(CFG)
    for rid in rids:
        _add(sched, rid, None)
    return {rid: [ev.token for ev in evs] for rid, evs in _by_rid(_run(sched, _same)).items()}


def _same(plan, out: StepOutput) -> StepOutput:
    return out


def test_hooks_reject_a_token_complete_a_document_and_cut_logprobs() -> None:
    tokens = _tokens(("a", "bb", "ccc"))

    def with_logprobs(plan, out: StepOutput) -> StepOutput:
        n = len(out.tokens)
        out.logprobs = [-0.5] * n
        out.top_logprobs = [[(7, -0.5), (8, -1.0), (9, -2.0)] for _ in range(n)]
        return out

    sched = Scheduler(CFG)
    rejecting = Hooks(reject=tokens["a"][2])
    completing = Hooks(logprobs=2, complete=tokens["bb"][1])
    quiet = Hooks()
    _add(sched, "a", rejecting, constrained=True)
    _add(sched, "bb", completing, constrained=True)
    _add(sched, "ccc", quiet)
    got = _by_rid(_run(sched, with_logprobs))
    first_reject = tokens["a"].index(tokens["a"][2])
    assert [ev.token for ev in got["a"]] == tokens["a"][:first_reject] + [None]
    assert (got["a"][-1].finish_reason, got["a"][-1].error) == (
        "error", f"token {tokens['a'][2]} is not allowed"
    )
    assert rejecting.seen == tokens["a"][:first_reject]
    first_complete = tokens["bb"].index(tokens["bb"][1])
    assert [ev.token for ev in got["bb"]] == tokens["bb"][: first_complete + 1]
    assert got["bb"][-1].finish_reason == "stop"
    assert all(ev.top_logprobs == [(7, -0.5), (8, -1.0)] and ev.logprob == -0.5
               for ev in got["bb"])
    assert not quiet.seen, "on_token is asked about constrained requests only"
    assert [ev.token for ev in got["ccc"]] == tokens["ccc"]
    assert all(ev.logprob is None and ev.top_logprobs is None for ev in got["ccc"])
    assert got["ccc"][-1].finish_reason == "length"
    for hooks, rid in ((rejecting, "a"), (completing, "bb"), (quiet, "ccc")):
        assert hooks.firsts == 1 and got[rid][0].embedding == [1.0]
        assert all(ev.embedding is None for ev in got[rid][1:])


def test_a_step_output_with_the_wrong_number_of_tokens_is_refused() -> None:
    sched = Scheduler(CFG)
    _add(sched, "a", None)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="sampled tokens for 1 sampling rows"):
        sched.commit(plan, StepOutput([3, 4]))


def test_tokens_of_a_request_ended_while_its_step_was_in_flight_are_dropped() -> None:
    sched = Scheduler(CFG)
    _add(sched, "a", None)
    exe = FakeExecutor(CFG)
    plan = sched.schedule()
    output = exe.execute(plan)
    sched.finish("a", "stop")  # a stop string matched while the step was in flight
    assert sched.commit(plan, output) == []
    exe.retire(plan.step)
    assert not sched.has_work() and sched.live == {}


def test_a_request_without_tokens_gets_its_first_event_fields_on_its_end() -> None:
    """max_tokens=0 (an embedding request): its one event, "length" with no token, carries them."""
    sched = Scheduler(CFG)
    hooks = Hooks()
    sched.add_request("e", [1, 2, 3], LedgerParams(max_tokens=0), hooks)
    (event,) = _run(sched, _same)
    assert (event.token, event.finish_reason, event.embedding) == (None, "length", [1.0])
    assert hooks.firsts == 1
