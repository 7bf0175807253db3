"""The metrics math on synthetic timings."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np

from benchmarks.metrics import RequestTiming, percentile, summarize
from benchmarks.serve_run import arrival_times


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert math.isclose(percentile(xs, q), float(np.percentile(xs, q)))


def test_tpot_excludes_the_first_token() -> None:
    t = RequestTiming(prompt_len=10, output_len=11, ttft=0.5, latency=1.5, success=True)
    assert math.isclose(t.tpot, 0.1)
    assert (
        RequestTiming(prompt_len=10, output_len=1, ttft=0.5, latency=0.5, success=True).tpot is None
    )


def test_summary_counts_throughput_and_pooled_itl() -> None:
    timings = [
        RequestTiming(100, 3, ttft=1.0, latency=3.0, itl=[1.0, 1.0], success=True),
        RequestTiming(50, 5, ttft=0.2, latency=1.0, itl=[0.2, 0.2, 0.2, 0.2], success=True),
        RequestTiming(70, error="HTTP 500"),
    ]
    s = summarize(timings, duration_s=4.0)
    assert (s.completed, s.failed, s.input_tokens, s.output_tokens) == (2, 1, 150, 8)
    assert math.isclose(s.request_throughput, 0.5) and math.isclose(s.output_throughput, 2.0)
    assert math.isclose(s.total_throughput, 158 / 4)
    assert math.isclose(s.ttft_s.mean, 0.6) and math.isclose(s.ttft_s.p50, 0.6)
    assert math.isclose(s.tpot_s.mean, (1.0 + 0.2) / 2)
    assert math.isclose(s.itl_s.p50, 0.2) and math.isclose(s.itl_s.mean, 2.8 / 6)
    assert math.isclose(s.e2e_s.p50, 2.0)
    empty = summarize([], 1.0)
    assert empty.completed == 0 and math.isnan(empty.ttft_s.p99)


def test_arrivals_all_at_once_or_poisson() -> None:
    assert arrival_times(4, math.inf, 0) == [0.0] * 4
    times = arrival_times(4000, 10.0, seed=1)
    assert times == arrival_times(4000, 10.0, seed=1) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) > 0 and abs(statistics.mean(gaps) - 0.1) < 0.01
    assert abs(statistics.pstdev(gaps) - 0.1) < 0.01  # exponential: sd == mean
