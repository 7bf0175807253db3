"""The deterministic-mode tests' probe request and params, neighbours' prompts and step loop."""

from __future__ import annotations

import random

from compiled_engine.sampling_params import SamplingParams

PROBE = [1, 17, 230, 45, 999, 3001, 12, 77, 640, 5, 88, 1234, 4321, 9, 66, 2500, 31, 700]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=2
)
MAX_STEPS = 3000


def run(engine, arrivals: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, tuple]:
    """Add each request at its step, step until done; each request's (tokens, logprobs, top
    logprobs)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    results: dict[str, tuple[list, list, list]] = {a[1]: ([], [], []) for a in arrivals}
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for event in engine.step():
            if event.token is not None:
                tokens, logprobs, tops = results[event.rid]
                tokens.append(event.token)
                logprobs.append(event.logprob)
                tops.append(event.top_logprobs)
        step += 1
        assert step < MAX_STEPS, "the engine did not finish"
    return {rid: (tuple(t), tuple(lp), repr(top)) for rid, (t, lp, top) in results.items()}


def others(draw_prompts, rng: random.Random) -> list[list[int]]:
    out = []
    for kind, length in draw_prompts:
        body = [rng.randrange(3, 7990) for _ in range(length)]
        # shares the probe's first tokens (a radix hit on its prefix), is the probe plus more, or is
        # unrelated
        head = {0: PROBE[: 1 + length % len(PROBE)], 1: PROBE, 2: []}[kind]
        out.append((head + body) or [1])
    return out
