"""`python -m benchmarks.jax_bridge`: what a JAX logits processor costs per decode
step, at batch 1 and 32 on the bench model, against the same rule built in (torch:
`repetition_penalty`) and against no processing, in one process, variants alternating.

Each measurement queues a batch of fresh 128-token prompts on the engine, steps until every request
decodes, then times `--steps` decode steps one by one; a variant's figure is the median step of its
best run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.engine_run import build_llm, close_llm
from benchmarks.models import BENCH_NAME, resolve_bench_model
from compiled_engine.sampling_params import SamplingParams

PENALTY = 1.3


@jax.jit
def jax_repetition_penalty(token_ids, logits):
    seen = jnp.zeros(logits.shape[0], dtype=bool).at[token_ids].set(True)
    return jnp.where(seen, jnp.where(logits > 0, logits / PENALTY, logits * PENALTY), logits)


VARIANTS = {
    "none": {},
    "torch (built-in repetition_penalty)": {"repetition_penalty": PENALTY},
    "JAX processor (same rule)": {"logits_processors": (jax_repetition_penalty,)},
}


def _step_ms(engine, batch: int, rng: random.Random, steps: int, extra: dict, tag: str) -> float:
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True, **extra)
    engine.keep_last_plan = True
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(3, 1000) for _ in range(128)], params)
    while (
        engine.scheduler.stats().num_waiting
        or engine.last_plan is None
        or not engine.last_plan.is_decode
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    return statistics.median(times) * 1e3


def measure(model: str, batches: list[int], steps: int, repeats: int) -> list[dict]:
    llm = build_llm(resolve_bench_model(model))
    rng = random.Random(0)
    rows = []
    try:
        for batch in batches:
            best: dict[str, float] = {}
            for r in range(repeats):
                for name, extra in VARIANTS.items():
                    ms = _step_ms(
                        llm.engine, batch, rng, steps, extra, f"{batch}-{r}-{len(best)}-{name[:5]}"
                    )
                    best[name] = min(best.get(name, float("inf")), ms)
            for name, ms in best.items():
                rows.append(
                    {
                        "batch": batch,
                        "variant": name,
                        "step_ms": ms,
                        "over_none_ms": ms - best["none"],
                    }
                )
    finally:
        close_llm(llm)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=BENCH_NAME)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = measure(args.model, [int(b) for b in args.batch.split(",")], args.steps, args.repeats)
    print("| batch | variant | decode step ms | over no processing, ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['step_ms']:.2f} | {r['over_none_ms']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "steps": args.steps, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
