"""Overlap as it runs on CUDA, simulated on the CPU: the runner is told its launches only queue work
(`asynchronous`), and each step's readback event is a fake that logs when it is waited on. The
engine must launch step k+1 before it waits for step k's tokens, wait once per step, use no thread,
and still give transformers' greedy tokens (step k+1 reads step k's token from the device token
table)."""

from __future__ import annotations

from compiled_engine import LLM, SamplingParams
from tests.engine.conftest import NEW_TOKENS, ragged_prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


class LoggedEvent:
    def __init__(self, log: list[tuple[str, int]], step: int) -> None:
        self.log, self.step = log, step

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append(("wait", self.step))


def _queued_launch_engine(demo_dir: str, log: list[tuple[str, int]], **settings) -> LLM:
    llm = LLM(demo_dir, enforce_eager=True, overlap=True, num_pages=2000, **settings)
    runner = llm.engine.runner
    runner.asynchronous = True
    launches = iter(range(1 << 30))
    step = {"n": -1}
    launch = runner.launch

    def logged_launch(batch, rows, kept=()):
        step["n"] = next(launches)
        log.append(("launch", step["n"]))
        return launch(batch, rows, kept)

    runner.launch = logged_launch
    runner.make_event = lambda: LoggedEvent(log, step["n"])
    return llm


def test_step_k_plus_1_is_launched_before_step_k_is_waited_for(demo_dir: str, hf_greedy) -> None:
    log: list[tuple[str, int]] = []
    llm = _queued_launch_engine(demo_dir, log, max_running=8)
    prompts = ragged_prompts(8, seed=3)
    outputs = llm.generate(prompts, GREEDY)
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == hf_greedy(prompt)
    launched = [i for kind, i in log if kind == "launch"]
    waited = [i for kind, i in log if kind == "wait"]
    assert waited == launched  # every step waited on exactly once, in order
    assert len(launched) > NEW_TOKENS
    at = {entry: n for n, entry in enumerate(log)}
    overlapped = [i for i in launched[:-1] if at[("launch", i + 1)] < at[("wait", i)]]
    # Only where the scheduler had nothing to plan (the last steps) may a wait come first.
    assert len(overlapped) >= len(launched) - 3, log
    assert llm.engine._worker is None  # no forward thread: the device queue is the overlap


def test_queued_launches_through_retraction_and_chunked_prefill(demo_dir: str, hf_greedy) -> None:
    prompts = ragged_prompts(37)
    llm = LLM(
        demo_dir, enforce_eager=True, overlap=True, num_pages=140, max_running=37, chunk_budget=24
    )
    llm.engine.runner.asynchronous = True
    outputs = llm.generate(prompts, GREEDY)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.token_ids == hf_greedy(prompt), f"prompt {i}"
    assert llm.engine.scheduler.stats().num_retractions > 0
    llm.engine.scheduler.check_integrity()
