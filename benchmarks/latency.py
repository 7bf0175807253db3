"""`bench latency`: decode step time at fixed batch sizes, and prefill throughput of one long
prompt.

A decode step's time is the median gap between a request's successive tokens while the whole batch
decodes together (every step emits one token per request); tokens/s = batch / step time.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from benchmarks.datasets import BenchRequest, LengthRange, Session, random_dataset
from benchmarks.engine_run import build_llm, close_llm, run_rounds


@dataclass
class DecodePoint:
    batch: int
    step_ms: float
    tokens_per_s: float


@dataclass
class LatencyRun:
    label: str
    decode: list[DecodePoint] = field(default_factory=list)
    prefill_len: int = 0
    prefill_tokens_per_s: float = 0.0


PREFILL_REPEATS = 3


def latency_workloads(
    batches: list[int], input_len: int, output_len: int, prefill_len: int, vocab: int, seed: int
) -> tuple[list[list[Session]], list[Session]]:
    """One workload per batch size (all prompts distinct), and the prefill probes (one prompt
    each)."""
    decode = [
        random_dataset(
            b,
            LengthRange(input_len, input_len),
            LengthRange(output_len, output_len),
            vocab,
            seed + b,
        )
        for b in batches
    ]
    rng = random.Random(seed - 1)
    prefill = [[BenchRequest([rng.randrange(3, vocab) for _ in range(prefill_len)], 1)]
               for _ in range(PREFILL_REPEATS)]
    return decode, prefill


def measure(model_dir: str, label: str, settings: dict, decode: list[list[Session]],
            prefill: list[Session]) -> LatencyRun:
    llm = build_llm(model_dir, **settings)
    run = LatencyRun(label, prefill_len=len(prefill[0][0].prompt_ids))
    try:
        for sessions in decode:
            t = run_rounds(llm, sessions)
            step = statistics.median(x for r in t.timings for x in r.itl)
            run.decode.append(DecodePoint(len(sessions), step * 1e3, len(sessions) / step))
        ttfts = [run_rounds(llm, [s]).timings[0].ttft for s in prefill]
        run.prefill_tokens_per_s = run.prefill_len / statistics.median(ttfts)
    finally:
        close_llm(llm)
    return run
