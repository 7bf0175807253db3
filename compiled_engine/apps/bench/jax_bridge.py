"""`python -m compiled_engine.apps.bench.jax_bridge`: what a JAX logits processor costs per decode step, at
batch 1 and 32 on the bench model, against the same rule built in (torch: `repetition_penalty`) and against
no processing, in one process, variants alternating.

A step's time is the difference between two runs of the same batch that generate `--short` and `--long`
tokens, divided by the extra tokens: prefill and start-up cancel out.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jax
import jax.numpy as jnp

from compiled_engine.apps.bench.engine_run import build_llm, close_llm
from compiled_engine.apps.bench.models import BENCH_NAME, resolve_bench_model
from compiled_engine.scheduler.sampling_params import SamplingParams

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


def _generate_s(llm, prompts: list[list[int]], tokens: int, extra: dict) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def measure(model: str, batches: list[int], short: int, long: int, repeats: int) -> list[dict]:
    llm = build_llm(resolve_bench_model(model))
    rng = random.Random(0)
    rows = []
    try:
        for batch in batches:
            prompts = [[rng.randrange(3, 1000) for _ in range(128)] for _ in range(batch)]
            best: dict[str, float] = {}
            for _ in range(repeats):
                for name, extra in VARIANTS.items():
                    step = (_generate_s(llm, prompts, long, extra) - _generate_s(llm, prompts, short, extra))
                    best[name] = min(best.get(name, float("inf")), step / (long - short))
            for name, step_s in best.items():
                rows.append({"batch": batch, "variant": name, "step_ms": step_s * 1e3,
                             "over_none_ms": (step_s - best["none"]) * 1e3})
    finally:
        close_llm(llm)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=BENCH_NAME)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = measure(args.model, [int(b) for b in args.batch.split(",")], args.short, args.long, args.repeats)
    print("| batch | variant | decode step ms | over no processing, ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['step_ms']:.2f} | {r['over_none_ms']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "short": args.short, "long": args.long, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
