"""`bench priority`: the time to the first token of a high-priority request on an idle engine and
under a saturating low-priority load (every running place taken, more waiting), with
`--scheduling-policy priority` and with fcfs, side by side in one process.

Each round, for each engine: idle (the request alone), then loaded (`low` requests of `prompt_len`
tokens and `low_tokens` output tokens each, stepped until they run, then the high-priority request
is added and timed to its first token; the load is aborted after). Best round kept. The engine is
driven directly, in process (tp_size 1): a server adds its HTTP handling to both sides alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams


def _first_token_s(engine, prompt: list[int], priority: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, priority=priority)
    t0 = time.perf_counter()
    engine.add_request("high", prompt, params)
    while True:
        if any(ev.rid == "high" and ev.token is not None for ev in engine.step()):
            seconds = time.perf_counter() - t0
            break
    engine.abort("high")
    return seconds


def _drain(engine) -> None:
    while engine.has_work():
        engine.step()


def run(model_dir: str, low: int, prompt_len: int, low_tokens: int, rounds: int,
        log: Callable[[str], None], **settings) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(prompt_len)] for _ in range(low + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=low_tokens, ignore_eos=True)
    engines = {policy: LLM(model_dir, scheduling_policy=policy, **settings).engine
               for policy in ("priority", "fcfs")}
    best: dict[str, float] = {}
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}")
        for policy, engine in engines.items():
            high = 0 if policy == "fcfs" else -1
            idle = _first_token_s(engine, prompts[-1], high)
            _drain(engine)
            for i in range(low):
                engine.add_request(f"low{i}", prompts[i], params)
            for _ in range(10 * low):  # (a pool too small for them all stops the wait)
                if len(engine.scheduler.running) >= engine.scheduler.config.max_running:
                    break
                engine.step()
            for _ in range(3):  # decoding
                engine.step()
            loaded = _first_token_s(engine, prompts[-1], high)
            for i in range(low):
                engine.abort(f"low{i}")
            _drain(engine)
            for key, value in ((f"{policy}_idle_ttft_s", idle),
                               (f"{policy}_loaded_ttft_s", loaded)):
                best[key] = min(best.get(key, value), value)
    for engine in engines.values():
        engine.shutdown()
    return best | {
        "priority_loaded_vs_idle": best["priority_loaded_ttft_s"] / best["priority_idle_ttft_s"],
        "fcfs_loaded_vs_idle": best["fcfs_loaded_ttft_s"] / best["fcfs_idle_ttft_s"],
    }
