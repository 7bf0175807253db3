"""Priority scheduling in the ledger: a waiting request of a better rank preempts the running one
of the worst rank (which recomputes and gives the same tokens), aging lets an old request of a
worse priority outrank newer ones, and under fcfs a priority is refused."""

from __future__ import annotations

import pytest

from compiled_engine.scheduler import LedgerParams, RequestRejected, Scheduler, SchedulerConfig
from tests.scheduler.fake_executor import FakeExecutor, plan_step, reference_output

VOCAB = 64


def _config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**({"num_pages": 40, "page_size": 2, "max_running": 1,
                               "max_context": 64, "policy": "priority"} | overrides))


def _step(sched: Scheduler, exe: FakeExecutor) -> list:
    plan = plan_step(sched)
    assert plan is not None
    events = sched.commit(plan, exe.execute(plan))
    exe.retire(plan.step)
    sched.check_integrity()
    return events


def _params(priority: int, max_tokens: int = 12) -> LedgerParams:
    return LedgerParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)


def test_a_better_rank_preempts_and_both_finish_with_their_tokens() -> None:
    cfg = _config()
    sched, exe = Scheduler(cfg), FakeExecutor(cfg, VOCAB)
    sched.add_request("low", [3, 4, 5, 6], _params(5))
    finished, outputs = [], {"low": [], "high": []}
    for step in range(40):
        if step == 4:
            sched.add_request("high", [7, 8, 9], _params(0, 3))
        if not sched.has_work():
            break
        for ev in _step(sched, exe):
            if ev.token is not None:
                outputs[ev.rid].append(ev.token)
            if ev.finished:
                finished.append(ev.rid)
    assert sched.num_preemptions == 1 and finished == ["high", "low"]
    for rid, prompt, n in (("low", [3, 4, 5, 6], 12), ("high", [7, 8, 9], 3)):
        assert outputs[rid] == reference_output(prompt, len(prompt) + n, frozenset(), 0, VOCAB)


def test_aging_lets_an_old_request_outrank_newer_better_ones() -> None:
    """`old` (priority 3, aged one level per 2 steps) waits behind `busy` while a priority-0
    request arrives every step: it runs after the ones that arrived within 2 x 3 steps of it, and
    before every later one."""
    cfg = _config(aging_steps=2)
    sched, exe = Scheduler(cfg), FakeExecutor(cfg, VOCAB)
    sched.add_request("busy", [3, 4], _params(0, 20))
    _step(sched, exe)
    sched.add_request("old", [5, 6], _params(3, 2))
    order = []
    for step in range(200):
        if step < 60:
            sched.add_request(f"new{step}", [7, 8], _params(0, 2))
        order += [ev.rid for ev in _step(sched, exe) if ev.finished]
        if "old" in order:
            break
    assert order == ["busy", *(f"new{k}" for k in range(6)), "old"]


def test_fcfs_refuses_a_priority() -> None:
    sched = Scheduler(_config(policy="fcfs"))
    with pytest.raises(RequestRejected, match="priority scheduling is not enabled"):
        sched.add_request("r", [3, 4], _params(1))
    sched.add_request("r", [3, 4], _params(0))  # the default is fine
