"""Latency and throughput math, shared by the offline and online benchmarks.

Definitions (as vLLM's `bench serve`): TTFT = first token time - send time; TPOT = (latency - TTFT)
/ (output tokens - 1) per request (requests with one token have none); ITL = the gaps between
successive streamed chunks, pooled over all requests; E2E = last token time - send time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """One request, times in seconds relative to its send time."""

    prompt_len: int
    output_len: int = 0  # tokens generated
    ttft: float | None = None
    latency: float | None = None  # end-to-end
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Summary:
    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_throughput: float  # (input + output) tokens/s
    ttft_s: Stats
    tpot_s: Stats
    itl_s: Stats
    e2e_s: Stats


def summarize(timings: list[RequestTiming], duration_s: float) -> Summary:
    ok = [t for t in timings if t.success]
    n_in = sum(t.prompt_len for t in ok)
    n_out = sum(t.output_len for t in ok)
    d = max(duration_s, 1e-9)
    return Summary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(timings) - len(ok),
        input_tokens=n_in,
        output_tokens=n_out,
        request_throughput=len(ok) / d,
        output_throughput=n_out / d,
        total_throughput=(n_in + n_out) / d,
        ttft_s=Stats.of([t.ttft for t in ok if t.ttft is not None]),
        tpot_s=Stats.of([t.tpot for t in ok if t.tpot is not None]),
        itl_s=Stats.of([x for t in ok for x in t.itl]),
        e2e_s=Stats.of([t.latency for t in ok if t.latency is not None]),
    )
