"""Building an engine from an `EngineConfig`: load the model, size the KV pool, compile the
graphs."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import kernels
from compiled_engine.config import EngineConfig
from compiled_engine.constraints import GrammarBook
from compiled_engine.engine import Engine
from compiled_engine.graph_bar import GraphBar
from compiled_engine.host_malloc import keep_freed_memory
from compiled_engine.kv_events.config import KVEventsConfig
from compiled_engine.kv_tier import keys as tier_keys
from compiled_engine.kv_tier.folder import open_store
from compiled_engine.kv_tier.tier import KVTier
from compiled_engine.layers.moe import expert_load
from compiled_engine.lora.registry import LoRARegistry
from compiled_engine.lora.slots import LoRASlots
from compiled_engine.models.loader import load_model
from compiled_engine.models.names import resolve_model
from compiled_engine.parallel import parallel_state as ps
from compiled_engine.request_state import RequestFeatures
from compiled_engine.runner.buckets import default_buckets
from compiled_engine.runner.device_defaults import deterministic_default
from compiled_engine.runner.model_runner import ModelRunner, RunnerConfig
from compiled_engine.runner.warmup import compile_graphs
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.scheduler import Scheduler
from compiled_engine.speculative.config import SpeculativeConfig
from compiled_engine.speculative.draft_model import load_draft_weights, start_draft_model
from compiled_engine.tokenization import load_tokenizer

if TYPE_CHECKING:  # pyzmq and msgspec are imported only where kv events are on
    from compiled_engine.kv_events.publisher import KVEventPublisher

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto`: the GPU when there is one; a GPU without an index is the current one (`cuda:0`
    unless set), so that every later use names the same device."""
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                          "cpu" if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def eos_token_ids(model_dir: str, hf_config) -> tuple[int, ...]:
    """Every EOS id: generation_config.json's (int or list) and the model config's."""
    ids: set[int] = set()
    for value in (
        _generation_config(model_dir).get("eos_token_id"),
        getattr(hf_config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def _generation_config(model_dir: str) -> dict:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize


def size_kv_pool(
    config: EngineConfig, model: torch.nn.Module, max_context: int, device: torch.device,
    draft: torch.nn.Module | None = None,
) -> int:
    """Pages for the KV pool: `num_pages` if given, else a fraction of memory, capped at what
    `max_running` full-length requests could use. A speculative draft model keeps its own KV for the
    same slots: a slot costs both models' bytes. The pool size shapes the compiled graphs (and so
    the compile-cache key), so it must not move between starts: on the CPU it is a fraction of total
    memory (of available memory only when that is less), rounded down to a power of two; sized from
    available memory, it flipped between two powers of two from one start to the next where the
    fraction sat near one, and every flip recompiled."""
    if config.num_pages is not None:
        return config.num_pages
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * config.mem_fraction
    else:
        total, available = _host_memory()
        budget = min(total * config.mem_fraction, available * 0.9)
    per_token = kv_bytes_per_token(model) + (kv_bytes_per_token(draft) if draft is not None else 0)
    by_memory = int(budget) // per_token // config.page_size
    by_memory = 1 << max(1, by_memory.bit_length() - 1)
    return max(2, min(by_memory, -(-config.max_running * max_context // config.page_size) + 1))


def _host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            info[name] = int(value.split()[0]) * 1024
    page = os.sysconf("SC_PAGE_SIZE")
    return (info.get("MemTotal", page * os.sysconf("SC_PHYS_PAGES")),
            info.get("MemAvailable", page * os.sysconf("SC_AVPHYS_PAGES")))


def start_kv_events(config: EngineConfig, scheduler: Scheduler) -> KVEventPublisher | None:
    """TP rank 0's publisher of the prefix cache's events, when `config.kv_events` enables them
    (every rank's cache is the same)."""
    kv_events = KVEventsConfig.parse(config.kv_events)
    if kv_events is None or not kv_events.enabled or ps.get_tp_rank() != 0:
        return None
    if config.prefix_cache != "radix":
        raise ValueError("kv events need the radix prefix cache (--prefix-cache radix)")
    from compiled_engine.kv_events.publisher import KVEventPublisher

    scheduler.cache.events = []
    return KVEventPublisher(kv_events, config.page_size)


def start_tier(config: EngineConfig, model_dir: str, runner: ModelRunner, scheduler: Scheduler,
               engine: Engine) -> KVTier | None:
    """This rank's KV tier under `config.kv_cache_dir` (None without one): a store per model,
    dtype, KV layout and TP rank, so that no page is read where its bytes mean something else, all
    of them within one byte budget (`kv_tier.folder`)."""
    if config.kv_cache_dir is None:
        return None
    if config.prefix_cache != "radix":
        raise ValueError("the KV tier needs the radix prefix cache (--prefix-cache radix)")
    k = runner.k_caches[0]
    run = dict(model=tier_keys.files_identity(model_dir), dtype=str(k.dtype),
               quantization=config.quantization, load_format=config.load_format,
               random_seed=config.seed if config.load_format == "dummy" else None,
               kv_shape=list(k.shape[1:]), layers=len(runner.k_caches),
               page_size=config.page_size, tp_size=ps.get_tp_size(), torch=torch.__version__,
               device=k.device.type)
    seed = tier_keys.salt(**run, tp_rank=ps.get_tp_rank())
    if config.page_size < 16:
        log.warning("KV tier with --page-size %d: a file per %d token(s); --page-size 16 keeps "
                    "fewer, larger files", config.page_size, config.page_size)
    store = open_store(config.kv_cache_dir, tier_keys.salt(**run), ps.get_tp_rank(),
                       ps.get_tp_size(), int(config.kv_cache_disk_gb * 1e9))
    if scheduler.cache.events is None:
        scheduler.cache.events = []
    log.info("KV tier: %s holds %d pages (%.2f GB of this rank's %.2f)", store.root, len(store),
             store.bytes / 1e9, store.budget_bytes / 1e9)
    return KVTier(store, seed, config.page_size, runner.k_caches, runner.v_caches,
                  engine.tier_adapter_seeds)


def resolve_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with every device default filled in, once: deterministic mode (the device's
    measured default, logged with its reason), overlap (on with CUDA), the memory fraction of the
    KV pool, the decode buckets with a static graph."""
    deterministic = config.deterministic
    if deterministic is None:
        deterministic, why = deterministic_default(device, bool(config.speculative))
        if ps.get_tp_rank() == 0:
            log.info("%s (--deterministic / --no-deterministic to choose)", why)
    elif config.speculative and not deterministic and ps.get_tp_rank() == 0:
        log.warning("--no-deterministic with speculation: a request's tokens may differ from its "
                    "tokens without speculation (verify rows and decode rows round differently)")
    cuda = device.type == "cuda"
    if config.buckets is not None:
        buckets = sorted(config.buckets)
    else:
        max_bucket = config.max_bucket if config.max_bucket is not None else (
            config.max_running if cuda else 1)
        buckets = default_buckets(min(max_bucket, config.max_running))
    return dataclasses.replace(
        config,
        deterministic=deterministic,
        overlap=cuda if config.overlap is None else config.overlap,
        mem_fraction=config.mem_fraction or (0.8 if cuda else 0.25),
        buckets=buckets,
    )


def start_lora(config: EngineConfig, model: torch.nn.Module,
               device: torch.device) -> LoRARegistry | None:
    """The adapter slots in the model's linears and the adapters of `config.lora_modules` (None
    without `enable_lora`)."""
    if not config.enable_lora:
        return None
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {config.max_loras} and "
                         f"{config.max_lora_rank}")
    if not hasattr(model, "lora_linears"):
        raise ValueError(f"{type(model).__name__} serves no LoRA adapters")
    if config.compile_mode != "default":
        # freezing makes the slot buffers graph constants: a later adapter load would not be seen
        raise ValueError(f"LoRA adapters need compile_mode 'default', not {config.compile_mode!r}")
    slots = LoRASlots(model, config.max_loras, config.max_lora_rank, model.dtype, device)
    if config.max_cpu_loras is None:
        cpu = max(4 * config.max_loras, len(config.lora_modules))
    elif config.max_cpu_loras < len(config.lora_modules):
        raise ValueError(f"{len(config.lora_modules)} adapters in --lora-modules, more than "
                         f"--max-cpu-loras {config.max_cpu_loras}")
    else:
        cpu = config.max_cpu_loras
    registry = LoRARegistry(slots, cpu)
    for name, path in config.lora_modules:
        registry.add(name, path)
    return registry


def build_engine(
    config: EngineConfig, progress: Callable[[str, int], None] | None = None
) -> Engine:
    device = resolve_device(config.device)
    # the ISA caps; on the CPU the native kernels (built once; a no-op where loaded)
    kernels.init(device)
    if device.type == "cuda":
        # Make it current, so that every allocation, stream, event and Triton launch without an
        # explicit device lands there (a TP rank sets its own; at tp=1 `cuda:1` would otherwise run
        # half on cuda:0).
        torch.cuda.set_device(device)
    if device.type == "cpu":
        # a prefill step's large activations reuse pages instead of faulting fresh ones
        keep_freed_memory()
    config = resolve_config(config, device)
    model_dir = resolve_model(config.model)
    t0 = time.perf_counter()
    model, hf_config = load_model(
        model_dir,
        dtype=config.dtype,
        device=str(device),
        load_format=config.load_format,
        quantization=config.quantization,
    )
    max_context = config.max_context or hf_config.max_position_embeddings
    eos = eos_token_ids(model_dir, hf_config)
    speculative = SpeculativeConfig.parse(config.speculative)
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = load_draft_weights(speculative, config, device, hf_config)
    lora = start_lora(config, model, device)  # its slots count against the pool's memory
    num_pages = size_kv_pool(config, model, max_context, device,
                             draft.model if draft is not None else None)
    scheduler = Scheduler(
        SchedulerConfig(
            num_pages=num_pages,
            page_size=config.page_size,
            max_running=config.max_running,
            max_context=max_context,
            chunk_budget=config.chunk_budget,
            mixed=config.mixed,
            prefix_cache=config.prefix_cache,
            eos_token_ids=eos,
            vocab_size=hf_config.vocab_size,
            speculative=speculative.ledger() if speculative is not None else None,
            max_loras=config.max_loras if lora is not None else 0,
            policy=config.scheduling_policy,
        ),
    )
    runner = ModelRunner(
        model,
        RunnerConfig(
            max_rows=config.max_running,
            max_context=max_context,
            page_size=config.page_size,
            num_pages=num_pages,
            buckets=config.buckets,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            deterministic=config.deterministic,
            compile_mode=config.compile_mode,
        ),
        device,
    )
    log.info(
        "loaded %s in %.1fs: %d KV pages of %d tokens",
        model_dir,
        time.perf_counter() - t0,
        num_pages,
        config.page_size,
    )
    report = None
    if not config.enforce_eager:
        bar = progress or (GraphBar() if ps.get_tp_rank() == 0 else None)
        try:
            report = compile_graphs(config, hf_config, runner, bar)
        finally:
            if bar is not None:
                bar.close()
        expert_load(model, reset=True)  # the warm-up's dummy tokens are no one's load
    draft_model = None
    if draft is not None:
        draft_model = start_draft_model(draft, config, runner.config, device)
    grammars = GrammarBook(functools.partial(load_tokenizer, model_dir), hf_config.vocab_size, eos)
    features = RequestFeatures(eos, device, grammars, speculative, draft_model)
    engine = Engine(config, model, scheduler, runner, features, report,
                    start_kv_events(config, scheduler), lora)
    engine.tier = start_tier(config, model_dir, runner, scheduler, engine)
    if engine.tier is not None and engine.kv_events is not None:
        engine.tier.store.track_removed = True  # their "DISK" removals are published
    for adapter in ([] if lora is None else lora.by_name.values()):
        engine.seed_adapter(adapter.id, adapter.path)
    # What exists now lives as long as the engine: take it out of the cyclic GC, whose full
    # collections otherwise re-scan every object of torch, transformers and the graphs: long pauses
    # in the middle of serving (docs/benchmarks.md). `Engine.shutdown` gives them back.
    gc.collect()
    gc.freeze()
    return engine

