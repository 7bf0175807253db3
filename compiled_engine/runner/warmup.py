"""The runner's warm-up: every graph a step can meet, compiled (or loaded precompiled) before
serving, through the compile cache (`compile_graphs`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from compiled_engine.runner.step_inputs import StepInputs, build_step_inputs
from compiled_engine.scheduler.plan import ReqStep, StepPlan
from kernels import ops as kernel_ops

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from compiled_engine.config import EngineConfig
    from compiled_engine.runner.compile_cache.session import CompileReport
    from compiled_engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


def compile_graphs(config: EngineConfig, hf_config: PretrainedConfig, runner: ModelRunner,
                   progress: Callable[[str, int], None] | None) -> CompileReport:
    """Every graph of `runner`'s model, through the compile cache (`config.compile_cache_dir`):
    loaded when an entry for these settings exists, else compiled and saved."""
    from compiled_engine.runner.compile_cache import (
        CacheEntry,
        cache_key,
        compile_with_cache,
        default_root,
    )

    model = runner.model
    key = cache_key(config, hf_config, model.dtype, runner.device, runner.config, model)
    root = default_root(config.compile_cache_dir)
    folder = CacheEntry(root, key.digest).precompiled_dir
    return compile_with_cache(key, root, lambda: warm_up(runner, progress, folder))


def warm_up(runner: ModelRunner, progress: Callable[[str, int], None] | None = None,
            precompiled_dir: Path | None = None) -> None:
    """Compile every decode bucket, the dynamic extend graph and (when batches can outgrow the
    largest bucket) the dynamic-batch decode graph now, through the path serving takes
    (`ModelRunner.logits`). The warm-up plans write nowhere (slot -1) and read only the dummy page.
    `progress(graph, total)` is called as each graph starts. With `precompiled_dir`, each graph is
    loaded from there, or compiled ahead of time and saved there (see `runner.precompiled`). A
    model with LoRA slots compiles each graph's LoRA variant too (on CUDA: the extend and
    dynamic-batch decode graphs', uncaptured)."""
    t0 = time.perf_counter()
    fwd = runner.forward
    max_rows = runner.config.max_rows
    # The dynamic-batch decode graph, for decode batches larger than the largest bucket (every batch
    # without buckets); traced at two rows at least, so that the batch dimension stays a symbol.
    largest = max(fwd.buckets, default=0)
    beyond = max(largest + 1, 2) if largest < max_rows else None
    lora = any(getattr(m, "lora_a", None) is not None for m in runner.model.modules())
    cuda = runner.device.type == "cuda"
    total = 1 + len(fwd.buckets) + (beyond is not None)
    if lora:
        total += 2 if cuda else total

    def tick(graph: str) -> None:
        if progress is not None:
            progress(graph, total)

    def decode(n: int, with_lora: bool = False) -> StepPlan:
        name = "decode, any batch" if n == beyond else f"decode, batch {n}"
        tick(name + (", LoRA" if with_lora else ""))
        return _plan([1] * n, max_rows, decode=True, lora=with_lora)

    def captured_inputs(n: int) -> StepInputs:
        return build_step_inputs(decode(n), runner.tables, n, runner.staging)

    fwd.precompiled_dir = precompiled_dir
    try:
        with torch.inference_mode():
            tick("prefill")
            # Two ragged plans, then one per extend kernel variant that a step can meet (CUDA: one
            # per request block; a padding request joins each step), so that serving compiles no
            # kernel.
            counts = kernel_ops.extend_request_counts(max_rows + 1, runner.device)
            for lengths in ([3, 5], [2, 1, 4], *([1] * (n - 1) for n in counts if n > 2)):
                runner.logits(_plan(lengths, max_rows, decode=False))
            if runner.device.type == "cuda":
                fwd.capture_cuda_graphs(captured_inputs)
            else:
                for n in sorted(fwd.buckets, reverse=True):
                    runner.logits(decode(n))
            if beyond is not None:
                runner.logits(decode(beyond))
            if lora:
                tick("prefill, LoRA")
                runner.logits(_plan([3, 5], max_rows, decode=False, lora=True))
                for n in [] if cuda else sorted(fwd.buckets, reverse=True):
                    runner.logits(decode(n, with_lora=True))
                if beyond is not None or cuda:
                    runner.logits(decode(beyond or max(largest, 2), with_lora=True))
    finally:
        fwd.precompiled_dir = None  # graphs are saved under the cache entry's lock only
    log.info(
        "compiled %d decode buckets + %d dynamic graphs in %.1fs",
        len(fwd.buckets),
        1 + (beyond is not None),
        time.perf_counter() - t0,
    )


def _plan(lengths: list[int], max_rows: int, decode: bool, lora: bool = False) -> StepPlan:
    """A plan that samples every request and writes nowhere; rows are shared when the pool has
    fewer. `lora`: its requests use adapter slot 0."""
    reqs = tuple(
        ReqStep(f"warmup-{i}", i % max_rows, 0, n, (-1,) * n, True, lora_slot=0 if lora else -1)
        for i, n in enumerate(lengths)
    )
    return StepPlan(step=-1, reqs=reqs, slot_writes=(), token_writes=(), is_decode=decode)
