"""`compiled-engine warmup`: compile every graph ahead of time into the compile cache; list or clear
it."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from compiled_engine.config import COMPILE_MODE_NAMES, EngineConfig
from compiled_engine.models.names import default_model
from compiled_engine.runner.buckets import parse_buckets


def add_warmup_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "warmup", help="compile every graph ahead of time into the compile cache (--list, --clear)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="as serve's --model, and the same default (smollm2, else the demo)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default=None,
                   help="as serve's --quantization")
    p.add_argument(
        "--buckets", type=parse_buckets, default=None, help="decode batch sizes, e.g. 1,2,4,8"
    )
    p.add_argument("--max-bucket", type=int, default=None)
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODE_NAMES,
        default=EngineConfig.compile_mode,
        help="CPU inductor options (freezing modes are not precompiled: they compile on every "
        "start)",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.deterministic,
        help="warm the graphs of serve's --deterministic or --no-deterministic (default: the "
        "device's, as serve)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="compile cache root (default: <cache root>/compile)"
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument(
        "--list", action="store_true", help="show cache entries with their key fields and sizes"
    )
    action.add_argument("--clear", nargs="?", const="", default=None, metavar="KEY_PREFIX",
                        help="remove every cache entry, or those whose key starts with KEY_PREFIX")
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args: argparse.Namespace) -> int:
    from compiled_engine.runner.compile_cache import default_root

    root = default_root(args.cache_dir)
    if args.list:
        return list_cache(root)
    if args.clear is not None:
        return clear_cache(root, args.clear)
    config = EngineConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        quantization=args.quantization,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running=args.max_running,
        max_context=args.max_context,
        buckets=args.buckets,
        max_bucket=args.max_bucket,
        tp_size=args.tp,
        compile_mode=args.compile_mode,
        compile_cache_dir=str(root),
        deterministic=args.deterministic,
    )
    return warm_up_cache(config)


def warm_up_cache(config: EngineConfig) -> int:
    from compiled_engine.startup import build_engine

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("compiled_engine.runner.compile_cache").setLevel(logging.INFO)
    if config.tp_size > 1:
        return _warm_up_ranks(config)
    engine = build_engine(config)
    entry = engine.compile_report.entry
    print(f"{entry.digest}  {_mb(entry.size())}  {entry.path}")
    return 0


def _warm_up_ranks(config: EngineConfig) -> int:
    """TP > 1: start the ranks as `serve` does (each compiles its own sharded graphs into its own
    cache entry, keyed by its rank), print their reports, stop them."""
    from compiled_engine.ranks.launcher import launch

    handle = launch(config)
    try:
        for rank, summary in enumerate(handle.ready.compile_summaries):
            print(f"rank {rank}: {summary}")
    finally:
        handle.shutdown()
    return 0


def list_cache(root: Path) -> int:
    from compiled_engine.runner.compile_cache import list_entries

    entries = list_entries(root)
    print(f"{root}: {len(entries)} entries")
    for entry in entries:
        manifest = entry.read_manifest() or {}
        problem = entry.problem()
        state = "complete" if problem is None else f"unusable ({problem})"
        print(f"{entry.digest}  {_mb(entry.size())}  {state}  {manifest.get('created', '-')}")
        for name, value in (manifest.get("key") or {}).items():
            print(f"    {name}: {value}")
    return 0


def clear_cache(root: Path, prefix: str) -> int:
    from compiled_engine.runner.compile_cache import clear_entries

    removed = clear_entries(root, prefix)
    for entry in removed:
        print(f"removed {entry.path}")
    if prefix and not removed:
        print(f"no cache entry under {root} starts with {prefix!r}", file=sys.stderr)
        return 1
    return 0


def _mb(size: int) -> str:
    return f"{size / 1e6:8.1f} MB"
