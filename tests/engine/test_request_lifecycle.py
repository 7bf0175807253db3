"""Each way a request ends leaves nothing behind: finished, stopped from outside (a stop string),
aborted with a step in flight, failed (its logits processor raised), rejected at admission,
retracted then finished. The check is one over every registry that remains on a rank: the ledger's
queues and in-flight steps, the engine's in-flight steps, the page books (integrity), and the
engine's per-request state, which must be unreachable (a weak reference to it dies) once the request
has ended. Compiled bf16 with overlap on (the configuration of test_deterministic's `tight` engine,
sharing its graphs), and eager fp32 without overlap; a pool small enough to retract."""

from __future__ import annotations

import gc
import weakref

import pytest

from compiled_engine.config import EngineConfig
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.startup import build_engine

pytestmark = pytest.mark.slow

MAX_STEPS = 2000
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# The default (compiled, bf16, overlap), and eager fp32 without overlap (the other launch path).
@pytest.fixture(
    scope="module",
    params=[("bfloat16", False, True), ("float32", True, False)],
    ids=["compiled-bf16-overlap", "eager-fp32"],
)
def engine(demo_dir, request):
    dtype, eager, overlap = request.param
    engine = build_engine(
        EngineConfig(
            model=demo_dir,
            dtype=dtype,
            enforce_eager=eager,
            buckets=[1, 4],
            max_running=16,
            deterministic=True,
            num_pages=28,
            page_size=4,
            chunk_budget=8,
            overlap=overlap,
        )
    )
    yield engine
    engine.shutdown()


def _add(engine, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> weakref.ref:
    engine.add_request(rid, prompt, params)
    return weakref.ref(engine.scheduler.get_request(rid).hooks)


def _step_until(engine, done) -> list:
    """Step until `done(events so far)` or the engine is idle; every event."""
    events: list = []
    for _ in range(MAX_STEPS):
        if done(events) or not engine.has_work():
            return events
        events.extend(engine.step())
    raise AssertionError("the engine did not finish")


def _assert_nothing_left(engine, states: list[weakref.ref]) -> None:
    _step_until(engine, lambda _: False)  # drain what is in flight
    scheduler = engine.scheduler
    assert not engine.has_work()
    assert (
        not scheduler.live
        and not scheduler.waiting
        and not scheduler.running
        and not scheduler.inflight
    )
    scheduler.check_integrity()  # pages: free + cached == total, no locks held, rows free
    assert (
        scheduler.book.allocator.num_free + scheduler.book.cache.num_cached_pages
        == scheduler.allocator.total
    )
    gc.collect()
    assert [ref() for ref in states] == [None] * len(states), (
        "a registry still holds an ended request's state"
    )


def _ends(events: list) -> dict[str, str]:
    return {ev.rid: ev.finish_reason for ev in events if ev.finished}


def test_finished_requests_leave_nothing(engine) -> None:
    states = [_add(engine, f"done-{i}", [1, 5 + i, 9, 13]) for i in range(3)]
    events = _step_until(engine, lambda _: False)
    assert _ends(events) == {f"done-{i}": "length" for i in range(3)}
    _assert_nothing_left(engine, states)


def test_a_request_stopped_from_outside_leaves_nothing(engine) -> None:
    states = [_add(engine, "stopped", [1, 2, 3]), _add(engine, "neighbour", [1, 4, 5])]
    _step_until(engine, lambda evs: any(ev.rid == "stopped" and ev.token is not None for ev in evs))
    engine.finish("stopped")  # what the server does when a stop string matches
    events = _step_until(engine, lambda _: False)
    assert "stopped" not in _ends(events) and _ends(events) == {"neighbour": "length"}
    _assert_nothing_left(engine, states)


def test_an_aborted_request_leaves_nothing_even_with_its_step_in_flight(engine) -> None:
    states = [_add(engine, "aborted", [1, 2, 3, 4]), _add(engine, "kept", [1, 6, 7])]
    _step_until(engine, lambda evs: sum(ev.rid == "aborted" for ev in evs) >= 2)
    if engine.config.overlap:
        assert engine._inflight, "overlap keeps a step in flight between calls"
    engine.abort("aborted")
    events = _step_until(engine, lambda _: False)
    assert not any(ev.rid == "aborted" for ev in events)  # no token after the abort
    assert _ends(events) == {"kept": "length"}
    _assert_nothing_left(engine, states)


def _raises(token_ids, logits):
    raise RuntimeError("boom")


def test_a_failed_request_leaves_nothing(engine) -> None:
    failing = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logits_processors=(_raises,)
    )
    states = [_add(engine, "failed", [1, 2, 3], failing), _add(engine, "fine", [1, 8, 9])]
    events = _step_until(engine, lambda _: False)
    assert _ends(events) == {"failed": "error", "fine": "length"}
    assert "boom" in next(ev.error for ev in events if ev.rid == "failed")
    _assert_nothing_left(engine, states)


def test_a_rejected_request_leaves_nothing(engine) -> None:
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("bad-params", [1, 2], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad-prompt", [], GREEDY)
    _assert_nothing_left(engine, [])


def test_retracted_then_finished_requests_leave_nothing(engine) -> None:
    before = engine.scheduler.num_retractions
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    states = [_add(engine, f"long-{i}", [1] + [20 + i] * 15, long) for i in range(4)]
    events = _step_until(engine, lambda _: False)
    assert engine.scheduler.num_retractions > before, "the pool was meant to force a retraction"
    assert _ends(events) == {f"long-{i}": "length" for i in range(4)}
    _assert_nothing_left(engine, states)
