"""Wall time of every engine step of the offline prefix workload: what each prefill step computed
(requests, new tokens) and how long it took, and the mean decode step. Shows where a median TTFT
comes from.

    .venv/bin/python -m benchmarks.prefix_step_times --prefix-cache naive --small

To compare two revisions on a noisy machine, alternate runs of this script against each: `git
worktree add /tmp/old REV`, then `PYTHONPATH=/tmp/old .venv/bin/python -m
benchmarks.prefix_step_times ...` (the engine comes from PYTHONPATH, so /tmp/old's) and the same
without PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from benchmarks.datasets import PrefixShape, prefix_dataset
from benchmarks.engine_run import build_llm, close_llm, run_rounds
from benchmarks.metrics import summarize
from benchmarks.models import bench_model_dir

# the benchmarks page's online shape
SMALL = PrefixShape(system_len=1024, num_shared=16, num_chats=4, turns=3)


@dataclass
class Step:
    requests: int
    new_tokens: int
    seconds: float = 0.0

    @property
    def is_decode(self) -> bool:
        return self.requests == self.new_tokens


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-cache", choices=["radix", "naive"], default="radix")
    parser.add_argument(
        "--small",
        action="store_true",
        help="16 shared + 4 chats x 3 turns (default: the dataset's)",
    )
    args = parser.parse_args()
    llm = build_llm(str(bench_model_dir()), prefix_cache=args.prefix_cache)
    engine, scheduler = llm.engine, llm.engine.scheduler
    steps: list[Step] = []
    schedule, step = scheduler.schedule, engine.step

    def timed_schedule():
        batch = schedule()
        if batch is not None:
            steps.append(Step(len(batch.reqs), sum(r.length for r in batch.reqs)))
        return batch

    def timed_step():
        start = time.perf_counter()
        events = step()
        steps[-1].seconds = time.perf_counter() - start
        return events

    scheduler.schedule, engine.step = timed_schedule, timed_step
    try:
        timings = run_rounds(
            llm, prefix_dataset(SMALL if args.small else PrefixShape(), vocab=32000)
        )
    finally:
        close_llm(llm)
    summary = summarize(timings.timings, timings.duration_s)
    print(
        f"{args.prefix_cache}: {timings.duration_s:.2f} s, median TTFT "
        f"{summary.ttft_s.p50 * 1e3:.0f} ms"
    )
    for s in steps:
        if not s.is_decode:
            print(
                f"  prefill step: {s.requests:3d} requests, {s.new_tokens:5d} new tokens: "
                f"{s.seconds * 1e3:7.1f} ms"
            )
    decodes = [s.seconds for s in steps if s.is_decode]
    if decodes:
        print(f"  {len(decodes)} decode steps, mean {sum(decodes) / len(decodes) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
