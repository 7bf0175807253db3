"""Driving our engine over a workload, timing every token.

The loop is `LLM.generate`'s (add requests, `engine.step()` until idle) on token-id prompts, without
the detokenizer: the bench model's vocabulary (32000) is larger than its demo tokenizer's, and the
field's throughput benchmarks count tokens, not text. Each round of the workload starts when the
previous one finished (turn t+1 of a chat after turn t).
"""

from __future__ import annotations

import gc
import itertools
import random
import time
from dataclasses import dataclass

from benchmarks.datasets import BenchRequest, Session, all_requests, rounds
from benchmarks.metrics import RequestTiming
from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.startup import resolve_device


@dataclass
class EngineTimings:
    timings: list[RequestTiming]
    duration_s: float
    cache_hit_rate: float
    outputs: dict[int, list[int]]  # index in `all_requests(sessions)` -> its generated tokens


# KV pool of every CPU bench engine unless --num-pages says otherwise: one fixed size (768 MiB on
# the bench model), because the pool's shape is part of the compile-cache key and varying it would
# recompile. On a GPU the pool is sized from its free memory (the same size on every run of one
# machine).
BENCH_PAGES = 65536
_rids = itertools.count()  # request ids unique within the process, across runs on one engine


def build_llm(model_dir: str, **engine_kwargs) -> LLM:
    """An `LLM` on `model_dir`, warmed up on two tiny requests."""
    if resolve_device(engine_kwargs.get("device", "auto")).type == "cpu":
        engine_kwargs.setdefault("num_pages", BENCH_PAGES)
    llm = LLM(model_dir, **engine_kwargs)
    rng = random.Random(-1)
    warm = [[BenchRequest([rng.randrange(3, 1000) for _ in range(n)], 4)] for n in (8, 16)]
    run_rounds(llm, warm)
    return llm


def close_llm(llm: LLM) -> None:
    """Shut the engine down and give its memory back (a GPU's too: the baseline that runs next needs
    it)."""
    device = llm.engine.runner.device if hasattr(llm.engine, "runner") else None
    llm.engine.shutdown()
    del llm
    gc.collect()
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def run_rounds(llm: LLM, sessions: list[Session]) -> EngineTimings:
    """Greedy, EOS ignored, every request exactly its output length."""
    engine = llm.engine
    timings: list[RequestTiming] = []
    index = {id(r): i for i, r in enumerate(all_requests(sessions))}
    outputs: dict[int, list[int]] = {}
    t_start = time.perf_counter()
    for batch in rounds(sessions):
        by_rid: dict[str, RequestTiming] = {}
        tokens: dict[str, list[int]] = {}
        last: dict[str, float] = {}
        sent = time.perf_counter()
        for req in batch:
            rid = f"bench-{next(_rids)}"
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, req.prompt_ids, params)
            by_rid[rid] = RequestTiming(prompt_len=len(req.prompt_ids))
            tokens[rid] = outputs.setdefault(index[id(req)], [])
        timings.extend(by_rid.values())
        while engine.has_work():
            events = engine.step()
            now = time.perf_counter()
            for ev in events:
                t = by_rid[ev.rid]
                if ev.token is not None:
                    if t.ttft is None:
                        t.ttft = now - sent
                    else:
                        t.itl.append(now - last[ev.rid])
                    last[ev.rid] = now
                    t.output_len += 1
                    tokens[ev.rid].append(ev.token)
                if ev.finished:
                    t.latency = now - sent
                    t.success = True
    duration = time.perf_counter() - t_start
    return EngineTimings(timings, duration, engine.scheduler.stats().cache_hit_rate, outputs)
