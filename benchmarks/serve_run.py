"""`bench serve`: a bounded workload against an OpenAI-compatible server.

Sessions start at Poisson arrival times (or all at once for rate `inf`); a session's requests are
sent one after the other. Every run has a fixed number of requests, a per-request timeout and an
overall deadline, after which unfinished requests count as failures.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from benchmarks.datasets import BenchRequest, Session
from benchmarks.metrics import RequestTiming, Summary, summarize
from benchmarks.openai_client import (
    completion_body,
    fetch_metrics,
    metric_value,
    stream_completion,
)

PromptOf = Callable[[BenchRequest], "list[int] | str"]


@dataclass
class ServeRun:
    label: str
    url: str
    request_rate: float  # requests/s; inf: all at once
    max_concurrency: int | None
    summary: Summary
    # the server's own since it started (its /metrics), when it reports one
    cache_hit_rate: float | None
    errors: list[str]  # the first few failure messages


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of n sessions: Poisson process of `rate`, or all zero for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class ServeOptions:
    model: str
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    deadline_s: float = 1800.0


async def run_serve(
    url: str, label: str, sessions: list[Session], opts: ServeOptions, prompt_of: PromptOf
) -> ServeRun:
    base = url.rstrip("/")
    endpoint = base + "/v1/completions"
    slots: list[list[RequestTiming]] = [
        [RequestTiming(len(r.prompt_ids), error="not sent before the deadline") for r in s]
        for s in sessions
    ]
    limit = asyncio.Semaphore(opts.max_concurrency or len(slots) or 1)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()

        async def session(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            for j, req in enumerate(sessions[i]):
                async with limit:
                    body = completion_body(opts.model, prompt_of(req), req.output_len)
                    slots[i][j] = await stream_completion(
                        client, endpoint, body, len(req.prompt_ids)
                    )
                if not slots[i][j].success:
                    for rest in slots[i][j + 1:]:
                        rest.error = "not sent: an earlier turn of its session failed"
                    return

        tasks = [asyncio.create_task(session(i, at))
                 for i, at in enumerate(arrival_times(len(sessions), opts.request_rate, opts.seed))]
        done, pending = await asyncio.wait(tasks, timeout=opts.deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            # a bug in the client surfaces here; server failures are recorded, not raised
            task.result()
        duration = time.perf_counter() - start
        hit_rate = metric_value(await fetch_metrics(client, base), "prefix_cache_hit_rate")
    timings = [t for s in slots for t in s]
    errors = [t.error for t in timings if not t.success][:5]
    return ServeRun(
        label,
        url,
        opts.request_rate,
        opts.max_concurrency,
        summarize(timings, duration),
        hit_rate,
        errors,
    )
