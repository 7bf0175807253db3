"""CPU cost of `schedule()` + `commit()` per decode step:
`python -m benchmarks.scheduler_step`.

The model is left out: each step "samples" a constant token, so only the ledger is timed. Two pools:
one with room to spare, and a full one (`--full-pool`: the prefix cache holds every page, as in a
warm server, so each new page of a decode comes from evicting a cached prefix).
"""

from __future__ import annotations

import argparse
import time

from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.plan import StepOutput
from compiled_engine.scheduler.scheduler import Scheduler


def bench_decode(
    running: int, page_size: int, steps: int, prompt_len: int = 128, full_pool: bool = False
) -> float:
    """Mean seconds of schedule() + commit() per decode step with `running` requests."""
    cfg = SchedulerConfig(
        num_pages=2 + running * (prompt_len + steps + 2 * page_size) // page_size,
        page_size=page_size,
        max_running=running,
        max_context=prompt_len + steps + 8,
        chunk_budget=running * prompt_len,
    )
    sched = Scheduler(cfg)
    if full_pool:
        _fill_cache(sched, cfg)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for i in range(running):
        sched.add_request(f"r{i}", [i % 1000 + 1] + [7] * (prompt_len - 1), params)
    plan = sched.schedule()  # one prefill step admits everyone
    assert plan is not None and len(plan.reqs) == running
    sched.commit(plan, StepOutput([3] * running))
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        assert plan is not None and plan.is_decode
        t1 = time.perf_counter()
        output = StepOutput([3] * len(plan.reqs))  # the "model" (not timed)
        t2 = time.perf_counter()
        sched.commit(plan, output)
        total += (t1 - t0) + (time.perf_counter() - t2)
    return total / steps


def _fill_cache(sched: Scheduler, cfg: SchedulerConfig, prompt_len: int = 16) -> None:
    """Run short distinct requests until the prefix cache holds every page (the free list is
    empty)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    i = 0
    while sched.allocator.num_free >= prompt_len // cfg.page_size + 2:
        for _ in range(cfg.max_running):
            sched.add_request(
                f"fill{i}", [1000 + i % 50_000, i // 50_000 + 1] + [9] * (prompt_len - 2), params
            )
            i += 1
        while sched.has_work():
            plan = sched.schedule()
            sched.commit(plan, StepOutput([3] * sum(r.sample for r in plan.reqs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--full-pool", action="store_true", help="the cache holds every page: decodes evict"
    )
    args = parser.parse_args()
    bench_decode(8, 1, 50)  # warm up
    pool = "  (full pool)" if args.full_pool else ""
    print(f"{'running':>8} {'page':>5} {'us/step':>10} {'us/req/step':>12}{pool}")
    for page_size in (1, 16):
        for running in (1, 64, 256):
            per_step = bench_decode(running, page_size, args.steps, full_pool=args.full_pool) * 1e6
            print(f"{running:>8} {page_size:>5} {per_step:>10.1f} {per_step / running:>12.2f}")


if __name__ == "__main__":
    main()
