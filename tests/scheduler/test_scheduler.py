"""Example tests of the scheduler core, one per known ledger pitfall of the field
(docs/architecture.md, "The ledger") and per feature."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine.scheduler import (
    LedgerParams,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    Status,
    StepOutput,
    StepPlan,
)
from tests.scheduler.fake_executor import FakeExecutor, reference_output, run_to_completion

VOCAB = 16
ROOT = Path(__file__).resolve().parents[2]


def make(**kw) -> tuple[Scheduler, FakeExecutor]:
    cfg = SchedulerConfig(**{"num_pages": 64, "max_running": 8, "max_context": 64, **kw})
    return Scheduler(cfg), FakeExecutor(cfg, vocab_size=VOCAB)


def ref(
    prompt: list[int], max_tokens: int, eos: tuple[int, ...] = (), min_tokens: int = 0
) -> list[int]:
    return reference_output(prompt, len(prompt) + max_tokens, frozenset(eos), min_tokens, VOCAB)


def outputs(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ev in events:
        if ev.token is not None:
            out.setdefault(ev.rid, []).append(ev.token)
    return out


def step(sched: Scheduler, exe: FakeExecutor) -> tuple[StepPlan, StepOutput]:
    batch = sched.schedule()
    assert batch is not None
    return batch, exe.execute(batch)


def commit(sched: Scheduler, exe: FakeExecutor, planned: tuple[StepPlan, StepOutput]):
    events = sched.commit(*planned)
    exe.retire(planned[0].step)
    sched.check_integrity()
    return events


def test_duplicate_prefix_insert_frees_duplicates_and_rewrites_row():
    sched, exe = make(page_size=2)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    sched.add_request("a", prompt, LedgerParams(max_tokens=4))
    sched.add_request("b", prompt, LedgerParams(max_tokens=4))
    first = step(sched, exe)
    assert [r.rid for r in first[0].reqs] == ["a", "b"]  # both prefill the same new prefix
    b = sched.get_request("b")
    b_pages_before = list(b.pages)
    events = commit(sched, exe, first)
    a = sched.get_request("a")
    assert b.pages[:4] == a.pages[:4], "b's row must now point at the cached pages"
    dups = [p for p in b_pages_before[:4] if p not in a.pages]
    assert len(dups) == 4 and all(sched.allocator.is_free(p) for p in dups)
    nxt = step(sched, exe)
    rewrite = [w for w in nxt[0].slot_writes if w.row == b.row and w.start == 0]
    assert rewrite and rewrite[0].slots == tuple(a.pages[i // 2] * 2 + i % 2 for i in range(8))
    events += commit(sched, exe, nxt) + run_to_completion(sched, exe)
    sched.check_integrity()
    assert outputs(events) == {"a": ref(prompt, 4), "b": ref(prompt, 4)}


def test_duplicate_prefix_under_overlap_frees_duplicates_only_after_the_step_reading_them():
    """Lag 1: b's next step is in flight, reading its own copies of the prefix, when the commit of
    the first step finds them duplicated: they stay b's until that step commits, then the row is
    rewritten."""
    sched, exe = make(page_size=2)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    sched.add_request("a", prompt, LedgerParams(max_tokens=4))
    sched.add_request("b", prompt, LedgerParams(max_tokens=4))
    first = step(sched, exe)
    b = sched.get_request("b")
    b_pages_before = list(b.pages)
    second = step(sched, exe)  # planned before the first commits (overlap)
    events = commit(sched, exe, first)
    a = sched.get_request("a")
    dups = [p for p in b_pages_before[:4] if p not in a.pages]
    assert len(dups) == 4 and b.pages[:4] == a.pages[:4]
    assert not any(sched.allocator.is_free(p) for p in dups), (
        "freed while the in-flight step reads them"
    )
    sched.check_integrity()
    third = step(sched, exe)  # the row rewrite goes out with the next plan
    rewrite = [w for w in third[0].slot_writes if w.row == b.row and w.start == 0]
    assert rewrite and rewrite[0].slots == tuple(a.pages[i // 2] * 2 + i % 2 for i in range(8))
    events += commit(sched, exe, second)
    assert all(sched.allocator.is_free(p) for p in dups)
    events += commit(sched, exe, third) + run_to_completion(sched, exe, lag=1)
    sched.check_integrity()
    assert sched.book.num_dedup_pages >= 4  # and the pages of their (identical) outputs later
    assert outputs(events) == {"a": ref(prompt, 4), "b": ref(prompt, 4)}


def test_overlap_finished_request_pages_not_reused_while_in_flight_and_no_token_after_stop():
    prompt = [5, 6, 7, 8]
    expected = ref(prompt, 10)
    stop = expected[1]
    cut = expected[: expected.index(stop) + 1]
    sched, exe = make(num_pages=16, page_size=1)
    sched.add_request("a", prompt, LedgerParams(max_tokens=10, stop_token_ids=(stop,)))
    events = []
    k0 = step(sched, exe)  # prefill a
    k1 = step(sched, exe)  # decode a, planned before k0 commits
    events += commit(sched, exe, k0)
    k2 = step(sched, exe)  # a's second token is in flight in k1; a assumed to continue
    events += commit(sched, exe, k1)  # a stops here (len(cut) == 2)
    a_slots = {s for k in (k0, k1, k2) for r in k[0].reqs if r.rid == "a" for s in r.out_slots}
    assert all(not sched.allocator.is_free(s) for s in a_slots), "freed while step k2 is in flight"
    sched.add_request("b", [9, 9, 9, 9, 9, 9, 9], LedgerParams(max_tokens=3))
    k3 = step(sched, exe)
    assert not {s for r in k3[0].reqs for s in r.out_slots} & a_slots
    events += commit(sched, exe, k2)  # a's discarded token
    events += commit(sched, exe, k3)
    events += run_to_completion(sched, exe, lag=1)
    assert [e.token for e in events if e.rid == "a"] == cut
    assert [e.finished for e in events if e.rid == "a"] == [False, True]
    sched.check_integrity()


def test_abort_during_in_flight_step_releases_once():
    sched, exe = make(num_pages=16)
    sched.add_request("a", [1, 2, 3, 4, 5], LedgerParams(max_tokens=8))
    k0 = step(sched, exe)
    k1 = step(sched, exe)
    sched.abort("a")
    sched.abort("a")  # second abort: no-op
    sched.check_integrity()
    assert commit(sched, exe, k0) == []
    assert commit(sched, exe, k1) == []
    assert not sched.has_work()
    assert sched.allocator.num_free + len(sched.cache.cached_pages()) == sched.allocator.total
    sched.abort("never-added")


@pytest.mark.parametrize("where", ["waiting", "mid-chunk", "running"])
def test_abort_anywhere_releases_everything(where):
    sched, exe = make(num_pages=16, chunk_budget=3)
    sched.add_request("a", [1, 2, 3, 4, 5, 6, 7], LedgerParams(max_tokens=8))
    if where != "waiting":
        commit(sched, exe, step(sched, exe))
        if where == "running":
            commit(sched, exe, step(sched, exe))
            commit(sched, exe, step(sched, exe))
            assert sched.get_request("a").planned_len >= 7
    sched.abort("a")
    sched.check_integrity()
    assert not sched.has_work()


def test_max_tokens_zero_emits_no_token():
    sched, exe = make()
    sched.add_request("a", [1, 2, 3], LedgerParams(max_tokens=0))
    events = run_to_completion(sched, exe)
    assert [(e.rid, e.token, e.finished, e.finish_reason) for e in events] == [
        ("a", None, True, "length")
    ]
    sched.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([1, 2], LedgerParams(max_tokens=-1), "max_tokens"),
        ([], LedgerParams(), "empty"),
        ([1] * 64, LedgerParams(), "context limit"),
        ([1, 2], LedgerParams(max_tokens=2, min_tokens=3), "min_tokens"),
        ([1, 2], LedgerParams(stop_token_ids=(-1,)), "stop_token_ids"),
        ([1, -2], LedgerParams(), "negative token"),
    ],
)
def test_bad_requests_rejected_with_clear_error(prompt, params, needle):
    sched, _ = make()
    with pytest.raises(RequestRejected, match=needle):
        sched.add_request("bad", prompt, params)
    assert not sched.has_work()
    assert issubclass(RequestRejected, ValueError)


def test_prompt_that_never_fits_the_pool_rejected():
    sched, _ = make(num_pages=5, page_size=2)  # 8 usable slots
    with pytest.raises(RequestRejected, match="KV pool"):
        sched.add_request("big", list(range(8)), LedgerParams())
    sched.add_request("fits", list(range(7)), LedgerParams())


def test_every_eos_id_is_honoured():
    prompt = [4, 4, 2]
    first = ref(prompt, 1)[0]
    other = (first + 1) % VOCAB
    for eos in [(other, first), (first, other)]:
        sched, exe = make(eos_token_ids=eos)
        sched.add_request("a", prompt, LedgerParams(max_tokens=5))
        events = run_to_completion(sched, exe)
        assert [(e.token, e.finish_reason) for e in events] == [(first, "stop")]


def test_min_tokens_and_ignore_eos():
    prompt = [4, 4, 2]
    first = ref(prompt, 1)[0]
    for params, n in [
        (LedgerParams(max_tokens=5, min_tokens=2), len(ref(prompt, 5, (first,), 2))),
        (LedgerParams(max_tokens=5, ignore_eos=True), 5),
    ]:
        sched, exe = make(eos_token_ids=(first,))
        sched.add_request("a", prompt, params)
        events = run_to_completion(sched, exe)
        assert len(events) == n > 1


def test_context_limit_finishes_with_length():
    sched, exe = make(max_context=10)
    sched.add_request("a", [1, 2, 3, 4, 5, 6], LedgerParams(max_tokens=100, ignore_eos=True))
    events = run_to_completion(sched, exe)
    assert len(events) == 4 and events[-1].finish_reason == "length"


def test_finish_hook_stops_request():
    sched, exe = make()
    sched.add_request("a", [1, 2, 3], LedgerParams(max_tokens=20, ignore_eos=True))
    commit(sched, exe, step(sched, exe))
    sched.finish("a", "stop")
    assert sched.get_request("a") is None
    assert run_to_completion(sched, exe) == []
    sched.check_integrity()


def test_chunked_prefill_continues_first():
    sched, exe = make(chunk_budget=4, mixed=False)
    prompt = list(range(2, 12))
    sched.add_request("a", prompt, LedgerParams(max_tokens=3))
    k0 = step(sched, exe)
    sched.add_request("b", [1, 1, 1], LedgerParams(max_tokens=3))
    commit(sched, exe, k0)
    k1 = step(sched, exe)
    commit(sched, exe, k1)
    k2 = step(sched, exe)
    lens = [[(r.rid, r.start, r.length, r.sample) for r in k[0].reqs] for k in (k0, k1, k2)]
    assert lens == [
        [("a", 0, 4, False)],
        [("a", 4, 4, False)],
        [("a", 8, 2, True), ("b", 0, 2, False)],
    ]
    events = commit(sched, exe, k2) + run_to_completion(sched, exe)
    assert outputs(events) == {"a": ref(prompt, 3), "b": ref([1, 1, 1], 3)}


def test_mixed_step_decodes_first():
    sched, exe = make(chunk_budget=4)
    sched.add_request("a", [1, 2], LedgerParams(max_tokens=5, ignore_eos=True))
    commit(sched, exe, step(sched, exe))
    sched.add_request("b", list(range(2, 9)), LedgerParams(max_tokens=2))
    batch, _ = planned = step(sched, exe)
    assert [(r.rid, r.length) for r in batch.reqs] == [("a", 1), ("b", 3)]
    assert not batch.is_decode
    commit(sched, exe, planned)


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("mixed", [True, False])
def test_retraction_under_tiny_pool_keeps_outputs(lag, page_size, mixed):
    sched, exe = make(
        num_pages=1 + 14 // page_size, page_size=page_size, max_running=4, mixed=mixed
    )
    prompts = {f"r{i}": [2 + i, 3, 4, 5, 6] for i in range(5)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, LedgerParams(max_tokens=7, ignore_eos=True))
    events = run_to_completion(sched, exe, lag=lag)
    sched.check_integrity()
    assert sched.num_retractions > 0
    assert outputs(events) == {rid: ref(p, 7) for rid, p in prompts.items()}


def test_no_starvation_fifo_admission():
    sched, exe = make(num_pages=9, max_running=2)
    prompts = {f"r{i}": [i % 5 + 2] * (3 + i % 4) for i in range(12)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, LedgerParams(max_tokens=4, ignore_eos=True))
    admitted: list[str] = []
    events = []
    while sched.has_work():
        batch, tokens = planned = step(sched, exe)
        rows = {w.row for w in batch.token_writes}
        admitted += [r.rid for r in batch.reqs if r.row in rows and r.rid not in admitted]
        events += commit(sched, exe, planned)
    assert admitted == list(prompts)  # first admissions in arrival order
    assert sorted(e.rid for e in events if e.finished) == sorted(prompts)


def test_prefix_cache_hit_statistics():
    sched, exe = make(page_size=2)
    shared = list(range(2, 12))
    sched.add_request("a", shared + [1], LedgerParams(max_tokens=2))
    run_to_completion(sched, exe)
    sched.add_request("b", shared + [3], LedgerParams(max_tokens=2))
    run_to_completion(sched, exe)
    assert sched.cache.hit_tokens == 10
    assert 0 < sched.stats().cache_hit_rate < 1


def test_naive_cache_reuses_nothing():
    sched, exe = make(prefix_cache="naive")
    for rid in "ab":
        sched.add_request(rid, [5, 6, 7, 8], LedgerParams(max_tokens=2))
        run_to_completion(sched, exe)
    assert sched.cache.hit_tokens == 0
    assert sched.allocator.num_free == sched.allocator.total


def _plans_script() -> str:
    return (
        "from compiled_engine.scheduler import *\nfrom tests.scheduler.fake_executor import "
        "FakeExecutor\ncfg = SchedulerConfig(num_pages=10, page_size=2, max_running=3, "
        "max_context=32, chunk_budget=5)\ns = Scheduler(cfg); x = FakeExecutor(cfg)\nfor i in "
        "range(8): s.add_request(f'req-{i}', [i % 3 + 2] * 4 + [i], LedgerParams(max_tokens=6))\n"
        "while s.has_work():\n    b = s.schedule(); print(b); s.commit(b, x.execute(b)); "
        "x.retire(b.step)\n"
    )


def test_plans_identical_across_hash_seeds():
    """TP ranks must agree: no dependence on set order / string hashing (PYTHONHASHSEED)."""
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", _plans_script()],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(res.stdout)
    assert runs[0] == runs[1] and runs[0].count("StepPlan(") > 5


def test_two_schedulers_same_inputs_same_plans():
    plans = []
    for _ in range(2):
        sched, exe = make(num_pages=10, page_size=2, max_running=3, chunk_budget=5)
        for i in range(8):
            sched.add_request(f"q{i}", [i % 3 + 2] * 4 + [i], LedgerParams(max_tokens=6))
        seq = []
        while sched.has_work():
            b = sched.schedule()
            seq.append(b)
            sched.commit(b, exe.execute(b))
            exe.retire(b.step)
        plans.append(seq)
    assert plans[0] == plans[1]


def test_status_transitions():
    sched, exe = make()
    sched.add_request("a", [1, 2], LedgerParams(max_tokens=1))
    req = sched.get_request("a")
    assert req.status is Status.WAITING
    planned = step(sched, exe)
    assert req.status is Status.RUNNING
    commit(sched, exe, planned)
    assert req.status is Status.FINISHED and req.finish_reason == "length"


def test_commit_out_of_order_and_three_in_flight_refused():
    sched, exe = make()
    sched.add_request("a", [1, 2], LedgerParams(max_tokens=9, ignore_eos=True))
    k0 = step(sched, exe)
    k1 = step(sched, exe)
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.commit(*k1)
    commit(sched, exe, k0)
    commit(sched, exe, k1)


def test_request_sharing_a_new_prefix_with_a_running_prefill_waits_and_then_hits_the_cache():
    sched, exe = make(page_size=4, max_context=128)
    system = [(7 * i) % 13 + 1 for i in range(48)]
    sched.add_request("a", system + [1, 2], LedgerParams(max_tokens=3))
    sched.add_request("b", system + [3, 4, 5], LedgerParams(max_tokens=3))
    first = step(sched, exe)
    assert [r.rid for r in first[0].reqs] == ["a"], (
        "b should wait for a's prefix instead of recomputing it"
    )
    events = commit(sched, exe, first)
    second = step(sched, exe)
    b_step = next(r for r in second[0].reqs if r.rid == "b")
    assert b_step.start == 48, "b computes only what the cache does not hold"
    events += commit(sched, exe, second)
    events += run_to_completion(sched, exe)
    out = outputs(events)
    assert out["a"] == ref(system + [1, 2], 3) and out["b"] == ref(system + [3, 4, 5], 3)
    assert sched.stats().cache_hit_rate > 0.4
