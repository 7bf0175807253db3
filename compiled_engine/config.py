"""Engine settings shared by `LLM`, `serve`, `bench` and `warmup`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# `EngineConfig.compile_mode` values (their inductor options:
# `runner.compiled_forward.COMPILE_MODES`).
COMPILE_MODE_NAMES = ("default", "freezing", "max-autotune-freezing")


@dataclass
class EngineConfig:
    model: str = "demo"  # 'demo' or a local Hugging Face checkpoint directory
    dtype: str = "auto"  # auto follows the checkpoint
    device: str = "auto"  # auto: cuda when available, else cpu
    load_format: str = "auto"  # auto | dummy (random weights)
    # None: a GGUF file's quantized tensors stay packed; none: dequantized at load; int8 | int4:
    # weight-only group-wise quantization of every linear (models.loader.load_model)
    quantization: str | None = None
    page_size: int = 1
    num_pages: int | None = None  # KV pool size; None: sized from memory (mem_fraction)
    # cuda: of the memory free after loading weights (0.8); cpu: of all (0.25)
    mem_fraction: float | None = None
    max_running: int = 256
    max_context: int | None = None  # None: the model's max_position_embeddings
    chunk_budget: int = 8192  # tokens computed per step (chunked prefill)
    mixed: bool = True  # decode and prefill chunks share steps
    prefix_cache: str = "radix"  # radix | naive
    enforce_eager: bool = False
    buckets: list[int] | None = None  # decode batch sizes with compiled graphs
    # None: cpu 1 (batch 1, then one shape-generic decode graph for every larger batch: a graph per
    # batch size costs a compile each and buys no step time there, docs/benchmarks.md), cuda
    # max_running (a CUDA graph is captured per bucket); 0: no static decode graph
    max_bucket: int | None = None
    # None: on with CUDA; off on the CPU, where the planning thread competes with the compute
    # threads for the cores (slower than no overlap on 2 cores: docs/benchmarks.md).
    overlap: bool | None = None
    seed: int = 0
    tp_size: int = 1
    # check every step's plan + tokens agree across TP ranks (or COMPILED_ENGINE_TP_DEBUG=1)
    tp_debug: bool = False
    # a TP rank with no loop iteration for this long is hung: the engine fails
    rank_timeout_s: float = 300.0
    # None: <cache_root()>/compile (see compiled_engine.runner.compile_cache)
    compile_cache_dir: str | None = None
    compile_mode: str = "default"  # CPU inductor options: one of COMPILE_MODE_NAMES
    # Batch-invariant kernels: a request's tokens and logprobs depend on the request (and its seed)
    # only, never on its batch, chunking, the prefix cache, overlap or the step kind (README,
    # "Deterministic inference"). None: the device's measured default (runner.device_defaults).
    deterministic: bool | None = None
    # speculative decoding: vLLM's speculative_config ({"method": "ngram", "num_speculative_tokens":
    # k, ...}: `compiled_engine.speculative.config`); None: off
    speculative: dict | None = None
    # KV cache events for routers: vLLM's kv_events_config ({"enable_kv_cache_events": true,
    # "endpoint": ...}: `compiled_engine.kv_events.config`); None: off
    kv_events: dict | None = None
    # LoRA adapters (compiled_engine.lora): the device's adapter slots (the most distinct adapters
    # in a step), their largest rank, the adapters kept loaded (None: 4 x max_loras), and those
    # loaded at start as (name, path)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    # "fcfs" or "priority" (vLLM's --scheduling-policy: requests' `priority`, lower is sooner,
    # aged by one per 64 steps waited; a waiting request preempts running ones of a worse rank)
    scheduling_policy: str = "fcfs"
    # The KV tier (compiled_engine.kv_tier): prefix-cache pages kept on local disk under this
    # directory, at most `kv_cache_disk_gb` GB of them (None: no tier)
    kv_cache_dir: str | None = None
    kv_cache_disk_gb: float = 16.0
    extra: dict = field(default_factory=dict)


def json_object(value: dict | str | None, what: str, known: set[str]) -> dict | None:
    """A JSON flag's object (from a dict or its JSON text; None stays None); ValueError naming
    `what` when it is not an object or has a field outside `known`."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object, got {value!r}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")
    return value
