"""`compiled-engine bench offline | latency | serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.datasets import (
    LengthRange,
    PrefixShape,
    Session,
    all_requests,
    prefix_dataset,
    random_dataset,
)
from benchmarks.models import (
    BENCH_NAME,
    QWEN3_MOE_NAME,
    QWEN3_NAME,
    resolve_bench_model,
)
from benchmarks.report import table, write_json

# hf: transformers generate
COMPARE_CHOICES = ("hf", "hf-fp32", "naive", "overlap", "eager", "nondeterministic", "int8",
                   "int4")
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_OUTPUT = {"random": "64:256", "prefix": "32"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tokenizer(model_dir: str):
    """The checkpoint's tokenizer: `tokenizers` on tokenizer.json when there is one (no torch
    import)."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    from compiled_engine.tokenization import load_tokenizer

    return load_tokenizer(model_dir)


def prompt_vocab(model_dir: str, tokenizer) -> int:
    """Random prompt ids stay below both the tokenizer's and the model's vocabulary."""
    size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)
    config = Path(model_dir) / "config.json"
    if config.is_file():  # a checkpoint directory: no torch import (the serve client's case)
        return min(size, json.loads(config.read_text())["vocab_size"])
    from compiled_engine.models.loader import load_config

    return min(size, load_config(model_dir).vocab_size)


def _add_dataset_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    p.add_argument("--dataset", choices=("random", "prefix"), default="random")
    p.add_argument(
        "--num-prompts", type=int, default=num_prompts, help="random dataset: number of requests"
    )
    p.add_argument(
        "--input-len", default="64:512", help="random dataset: N or LO:HI (uniform), default 64:512"
    )
    p.add_argument("--output-len", default=None,
                   help="N or LO:HI (uniform); default 64:256 (random), 32 (prefix)")
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="widen a single length N to N*(1-r)..N*(1+r)"
    )
    p.add_argument(
        "--system-len",
        type=int,
        default=PrefixShape.system_len,
        help="prefix dataset: system prompt",
    )
    p.add_argument("--num-shared", type=int, default=PrefixShape.num_shared,
                   help="prefix dataset: single requests sharing the system prompt")
    p.add_argument(
        "--num-chats",
        type=int,
        default=PrefixShape.num_chats,
        help="prefix dataset: multi-turn chats",
    )
    p.add_argument(
        "--turns", type=int, default=PrefixShape.turns, help="prefix dataset: turns per chat"
    )
    p.add_argument("--seed", type=int, default=0)


def build_dataset(args: argparse.Namespace, vocab: int, seed_offset: int = 0) -> list[Session]:
    output = LengthRange.parse(args.output_len or DEFAULT_OUTPUT[args.dataset], args.range_ratio)
    if args.dataset == "random":
        return random_dataset(
            args.num_prompts,
            LengthRange.parse(args.input_len, args.range_ratio),
            output,
            vocab,
            args.seed + seed_offset,
        )
    shape = PrefixShape(
        system_len=args.system_len,
        num_shared=args.num_shared,
        num_chats=args.num_chats,
        turns=args.turns,
        output_len=output,
    )
    return prefix_dataset(shape, vocab, args.seed + seed_offset)


def _workload(args: argparse.Namespace, sessions: list[Session]) -> dict:
    reqs = all_requests(sessions)
    return {
        "dataset": args.dataset,
        "seed": args.seed,
        "num_requests": len(reqs),
        "num_sessions": len(sessions),
        "input_len": args.input_len if args.dataset == "random" else None,
        "output_len": args.output_len or DEFAULT_OUTPUT[args.dataset],
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        "max_output_tokens": sum(r.output_len for r in reqs),
    }


# ---- offline -------------------------------------------------------------------------------------

def _cmd_offline(args: argparse.Namespace) -> int:
    from benchmarks.offline import OfflineResult, run_offline

    model_dir = resolve_bench_model(args.model)
    sessions = build_dataset(args, prompt_vocab(model_dir, _tokenizer(model_dir)))
    settings = {
        "enforce_eager": args.enforce_eager,
        "overlap": False if args.disable_overlap else None,
        "prefix_cache": args.prefix_cache,
        **_placement(args),
    }
    if args.num_pages is not None:
        settings["num_pages"] = args.num_pages
    settings |= _mode_ab_base(args.compare)
    result = OfflineResult(args.model, args.dataset, _workload(args, sessions), settings)
    result.runs = run_offline(
        model_dir, sessions, settings, args.compare or [], log=_log, repeats=args.repeats
    )
    rows = [[r.label, r.summary.completed, r.summary.duration_s, r.summary.request_throughput,
             r.summary.output_throughput, r.summary.total_throughput, r.summary.ttft_s.p50,
             r.cache_hit_rate] for r in result.runs]
    print(table(["run", "requests", "time s", "req/s", "output tok/s", "total tok/s", "TTFT p50 s",
                 "cache hit rate"], rows))
    for label, ratio in result.ratios().items():
        ttft = (
            "" if math.isnan(ratio["ttft_p50"]) else f", {ratio['ttft_p50']:.2f}x lower median TTFT"
        )
        print(
            f"{result.runs[0].label} vs {label}: {ratio['throughput']:.2f}x output throughput{ttft}"
        )
    for run in result.runs[1:]:
        agree = run.tokens_vs_base
        print(
            f"{run.label}: greedy tokens identical to {result.runs[0].label}'s in "
            f"{agree.identical} of {agree.requests} requests; {agree.common_prefix:.1%} of each "
            "output before a first difference"
        )
    if args.json:
        write_json(args.json, "offline", result)
    if args.plot:
        from benchmarks.plots import plot_offline

        plot_offline(
            result.runs,
            f"offline, {args.dataset} dataset",
            Path(args.plot) / f"offline_{args.dataset}.png",
        )
    return 0


# ---- latency -------------------------------------------------------------------------------------

def _mode_ab_base(compare: list[str] | None) -> dict:
    """The base run's settings under `--compare nondeterministic`: deterministic, whatever the
    device's default."""
    return {"deterministic": True} if "nondeterministic" in (compare or []) else {}


def _cmd_latency(args: argparse.Namespace) -> int:
    from benchmarks.latency import latency_workloads, measure

    model_dir = resolve_bench_model(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    decode, prefill = latency_workloads(batches, args.input_len, args.output_len, args.prefill_len,
                                        prompt_vocab(model_dir, _tokenizer(model_dir)), args.seed)
    others = {"eager": {"enforce_eager": True}, "nondeterministic": {"deterministic": False}}
    base = _mode_ab_base(args.compare)
    variants = [("compiled", base)] + [(name, base | others[name]) for name in args.compare or []]
    runs = []
    # alternating, so that a slow spell of a shared machine hits every variant
    for _ in range(args.repeats):
        for label, settings in variants:
            _log(f"measuring {label} ...")
            runs.append(
                measure(model_dir, label, {**_placement(args), **settings}, decode, prefill)
            )
    rows = [[r.label, p.batch, p.step_ms, p.tokens_per_s] for r in runs for p in r.decode]
    print(table(["graphs", "batch", "decode step ms", "decode tok/s"], rows))
    print(
        table(
            ["graphs", "prefill tokens", "prefill tok/s"],
            [[r.label, r.prefill_len, r.prefill_tokens_per_s] for r in runs],
        )
    )
    for other in runs[1 : len(variants)]:
        for a, b in zip(runs[0].decode, other.decode, strict=True):
            ratio = b.step_ms / a.step_ms
            print(
                f"batch {a.batch}: compiled (default) {ratio:.2f}x faster decode step than "
                f"{other.label}"
            )
    if args.json:
        write_json(args.json, "latency", {"model": args.model, "input_len": args.input_len,
                                          "output_len": args.output_len, "runs": runs})
    if args.plot:
        from benchmarks.plots import plot_latency

        plot_latency(runs, Path(args.plot) / "decode_latency.png")
    return 0


# ---- serve ---------------------------------------------------------------------------------------

def _parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]


async def _serve_all(args: argparse.Namespace, workloads: list[list[Session]], prompt_of) -> list:
    """Every --url at every rate; rate i uses workload i (fresh prompts, so no rate reuses the KV
    cached by the previous one)."""
    import httpx

    from benchmarks.openai_client import first_model
    from benchmarks.serve_run import ServeOptions, run_serve

    labels = args.label or []
    runs = []
    for i, url in enumerate(args.url):
        label = labels[i] if i < len(labels) else url
        model = args.served_model
        if model is None:
            async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
                model = await first_model(client, url)
        for rate, sessions in zip(_parse_rates(args.request_rate), workloads, strict=True):
            opts = ServeOptions(
                model, rate, args.max_concurrency, args.seed, args.request_timeout, args.timeout
            )
            _log(f"{label}: request rate {rate} ...")
            runs.append(await run_serve(url, label, sessions, opts, prompt_of))
    return runs


def _cmd_serve(args: argparse.Namespace) -> int:
    args.url = args.url or [DEFAULT_URL]
    model_dir = resolve_bench_model(args.model)
    tokenizer = _tokenizer(model_dir)
    vocab = prompt_vocab(model_dir, tokenizer)
    workloads = [build_dataset(args, vocab, i) for i in range(len(_parse_rates(args.request_rate)))]
    prompt_of = lambda r: r.prompt_ids
    if args.prompt_format == "text":
        prompt_of = lambda r: tokenizer.decode(r.prompt_ids)
    runs = asyncio.run(_serve_all(args, workloads, prompt_of))
    rows = []
    for r in runs:
        s = r.summary
        rows.append(
            [
                r.label,
                "inf" if math.isinf(r.request_rate) else r.request_rate,
                s.completed,
                s.failed,
                s.request_throughput,
                s.output_throughput,
                s.ttft_s.mean * 1e3,
                s.ttft_s.p50 * 1e3,
                s.ttft_s.p99 * 1e3,
                s.tpot_s.p50 * 1e3,
                s.tpot_s.p99 * 1e3,
                s.itl_s.p99 * 1e3,
                s.e2e_s.p50,
                r.cache_hit_rate,
            ]
        )
    print(
        table(
            [
                "server",
                "rate",
                "ok",
                "failed",
                "req/s",
                "out tok/s",
                "TTFT mean ms",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "ITL p99 ms",
                "E2E p50 s",
                "cache hit rate",
            ],
            rows,
        )
    )
    for r in runs:
        for err in r.errors:
            _log(f"{r.label}: failed request: {err}")
    if args.json:
        write_json(args.json, "serve", {"workload": _workload(args, workloads[0]), "runs": runs})
    if args.plot:
        from benchmarks.plots import plot_serve

        plot_serve(runs, Path(args.plot))
    return 0 if all(r.summary.failed == 0 for r in runs) else 1


# ---- parser --------------------------------------------------------------------------------------

# ---- speculative ---------------------------------------------------------------------------------

DEFAULT_SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 7}'


def _cmd_speculative(args: argparse.Namespace) -> int:
    from benchmarks.speculative import run
    from compiled_engine.speculative.config import SpeculativeConfig

    spec = json.loads(args.speculative_config)
    SpeculativeConfig.parse(spec)
    settings = {"enforce_eager": args.enforce_eager} | _placement(args)
    if args.num_pages is not None:
        settings["num_pages"] = args.num_pages
    batches = [int(b) for b in args.batch.split(",")]
    rows = run(resolve_bench_model(args.model), spec, batches, args.rounds, args.max_tokens,
               log=_log, **settings)
    print(table(["workload", "batch", "plain tok/s", "speculative tok/s", "ratio", "acceptance",
                 "mean accepted length", "identical"],
                [[r["workload"], r["batch"], r["plain_tok_s"], r["spec_tok_s"], r["ratio"],
                  r["acceptance"], r["mean_accepted_length"], r["identical"]] for r in rows]))
    if args.json:
        write_json(args.json, "speculative", {"speculative": spec, "settings": settings,
                                              "rows": rows})
    return 0


def _cmd_lora(args: argparse.Namespace) -> int:
    from benchmarks.lora import run

    settings = _run_settings(args)
    result = run(resolve_bench_model(args.model), args.adapters, args.rank, args.requests,
                 args.prompt_len, args.output_len, args.rounds, args.peft_requests, log=_log,
                 **settings)
    return _report(args, "lora", settings, ("adapters", "rank", "requests", "prompt_len",
                                            "output_len", "peft_requests"), result)


def _cmd_tier(args: argparse.Namespace) -> int:
    from benchmarks.kv_tier import run

    settings = _run_settings(args) | {"page_size": args.page_size}
    result = run(resolve_bench_model(args.model), args.system_len, args.tenants, args.tenant_len,
                 args.rounds, args.index_pages, log=_log, **settings)
    return _report(args, "tier", settings, ("system_len", "tenants", "tenant_len", "index_pages"),
                   result)


def _cmd_batch(args: argparse.Namespace) -> int:
    from benchmarks.batch_api import run

    model = resolve_bench_model(args.model)
    serve_args = ["--model", model, *shlex.split(args.serve_args)]
    result = run(model, serve_args, args.requests, args.output_len, args.clients, log=_log)
    settings = {"serve_args": serve_args}
    return _report(args, "batch", settings, ("requests", "output_len", "clients"), result)


def _cmd_priority(args: argparse.Namespace) -> int:
    from benchmarks.priority import run

    settings = _run_settings(args) | {"max_running": args.max_running}
    result = run(resolve_bench_model(args.model), args.low, args.prompt_len, args.low_tokens,
                 args.rounds, log=_log, **settings)
    return _report(args, "priority", settings, ("low", "prompt_len", "low_tokens"), result)


def _run_settings(args: argparse.Namespace) -> dict:
    return {"enforce_eager": args.enforce_eager} | _placement(args)


def _report(args: argparse.Namespace, kind: str, settings: dict, workload: tuple[str, ...],
            result: dict) -> int:
    """Print a side-by-side benchmark's measures; with --json, write them with its settings."""
    print(table(["measure", "value"], [[k, round(v, 3)] for k, v in result.items()]))
    if args.json:
        asked = {k: getattr(args, k) for k in (*workload, "rounds")}
        write_json(args.json, kind, {"settings": settings | asked, "result": result})
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from benchmarks.router import bench_router

    result = bench_router(args.model, args.serve_args, args.replicas, args.routers.split(","),
                          args.overhead_requests, args.tenants, args.questions,
                          args.system_words, args.concurrency, Path(args.log_dir))
    print(table(["router", "direct median ms", "via router median ms", "overhead ms"],
                [[k, v["direct_median_ms"], v["router_median_ms"], v["overhead_ms"]]
                 for k, v in result["overhead"].items()]))
    print(table(["run", "prefix hit rate", "requests/s", "median latency ms",
                 "prompt tokens per replica"],
                [[k, v["hit_rate"], v["requests_per_s"], v["median_latency_ms"],
                  " / ".join(f"{q:.0f}" for q in v["tokens_looked_up_per_replica"])]
                 for k, v in result["workload"].items()]))
    if args.json:
        write_json(args.json, "router", result)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench", help="benchmarks: offline throughput, decode latency, online serving"
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    model_help = (
        f"'{BENCH_NAME}' (default: the random 768-hidden Llama), '{QWEN3_NAME}' (random, "
        f"Qwen3-0.6B's shape), '{QWEN3_MOE_NAME}' (random Qwen3-MoE, SmolLM2-135M's active "
        "size), 'demo', or a checkpoint directory"
    )

    p = kinds.add_parser(
        "offline", help="throughput of LLM.generate's loop on a workload, with baselines"
    )
    p.add_argument("--model", default=BENCH_NAME, help=model_help)
    _add_dataset_args(p, num_prompts=64)
    p.add_argument(
        "--compare",
        action="append",
        choices=COMPARE_CHOICES,
        help="also run: hf (transformers generate in the checkpoint's dtype), hf-fp32 (in fp32: "
        "its best on CPUs without a bf16 GEMM), naive (prefix cache), overlap (toggled), eager, "
        "nondeterministic (--no-deterministic), int8 / int4 (--quantization)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run our engine and every comparison this many times, alternating; each keeps its "
        "best",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--prefix-cache", choices=("radix", "naive"), default="radix")
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV pool size in pages (default 65536, fixed so that the compile cache is reused)",
    )
    _add_placement_args(p)
    _add_output_args(p)
    p.set_defaults(func=_cmd_offline)

    p = kinds.add_parser("latency", help="decode step time per batch size, and prefill throughput")
    p.add_argument("--model", default=BENCH_NAME, help=model_help)
    p.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument(
        "--compare",
        action="append",
        choices=("eager", "nondeterministic"),
        help="eager: also measure without graphs; nondeterministic: with --no-deterministic",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of every variant, alternating")
    p.add_argument("--seed", type=int, default=0)
    _add_placement_args(p)
    _add_output_args(p)
    p.set_defaults(func=_cmd_latency)

    p = kinds.add_parser(
        "serve", help="an OpenAI-API client: TTFT, TPOT, ITL, throughput against servers"
    )
    p.add_argument(
        "--url",
        action="append",
        default=None,
        help="server base URL (repeatable: same workload against each); default " + DEFAULT_URL,
    )
    p.add_argument("--label", action="append", help="a name per --url for the tables and plots")
    p.add_argument(
        "--served-model",
        default=None,
        help="the 'model' field sent (default: the first of /v1/models)",
    )
    p.add_argument(
        "--model",
        default=BENCH_NAME,
        help=f"tokenizer and vocabulary for the prompts: {model_help}",
    )
    _add_dataset_args(p, num_prompts=64)
    p.add_argument(
        "--request-rate",
        default="inf",
        help="req/s, Poisson arrivals; 'inf' or a list like 1,2,inf (rate i uses prompts of "
        "seed + i)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per run; then the rest fails"
    )
    _add_output_args(p)
    p.set_defaults(func=_cmd_serve)
    _add_speculative_parser(kinds)


def _add_speculative_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "speculative",
        help="decode with and without speculative decoding (A/B in one process): copy-heavy and "
        "free-generation chat workloads",
    )
    p.add_argument("--model", default="smollm2", help="a checkpoint with a chat template")
    p.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE)
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; each keeps its best")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-pages", type=int, default=None)
    _add_placement_args(p)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=_cmd_speculative)
    _add_router_parser(kinds)
    _add_lora_parser(kinds)
    _add_tier_parser(kinds)
    _add_priority_parser(kinds)
    _add_batch_parser(kinds)


def _add_run_args(p: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int]) -> None:
    """What the side-by-side engine benchmarks share: rounds, eager, placement, the JSON file."""
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; each keeps its best")
    p.add_argument("--enforce-eager", action="store_true")
    _add_placement_args(p)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=func)


def _add_batch_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "batch",
        help="the same requests through /v1/batches, through run-batch, and from concurrent "
        "clients",
    )
    p.add_argument("--model", default="bench")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--serve-args", default="", help="more flags for serve and run-batch")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=_cmd_batch, rounds=1)


def _add_priority_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "priority",
        help="time to the first token of a high-priority request, idle and under a saturating "
        "low-priority load, priority scheduling vs fcfs",
    )
    p.add_argument("--model", default="bench")
    p.add_argument("--low", type=int, default=48, help="low-priority requests (more than run)")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--low-tokens", type=int, default=256)
    _add_run_args(p, _cmd_priority)


def _add_tier_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "tier",
        help="the KV tier: time to the first token after a restart vs a cold prefill, and tenants "
        "whose prompts are 4x the pool with and without the tier",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--tenant-len", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a tier file)")
    p.add_argument("--index-pages", type=int, default=50_000,
                   help="pages of the store whose index is rebuilt")
    _add_run_args(p, _cmd_tier)


def _add_lora_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "lora",
        help="LoRA adapters mixed in one batch vs the base model alone (A/B in one process), and "
        "vs transformers + PEFT switching adapters per request",
    )
    p.add_argument("--model", default="bench")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--peft-requests", type=int, default=8)
    _add_run_args(p, _cmd_lora)


def _add_router_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "router",
        help="replicas behind sglang-router and vllm-router vs one replica: the router's latency "
        "and prefix hit rates by policy",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--serve-args", default="", help="more flags for every replica's serve")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default="sglang,vllm")
    p.add_argument("--overhead-requests", type=int, default=100,
                   help="requests each way for the overhead")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--questions", type=int, default=16, help="per tenant")
    p.add_argument("--system-words", type=int, default=500, help="words per system prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--log-dir", default="router-bench-logs")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=_cmd_router)


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when available), cpu, cuda or cuda:N; transformers' baseline runs there "
        "too",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of our engine")


def _placement(args: argparse.Namespace) -> dict:
    return {"device": args.device, "tp_size": args.tp}


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write PNG charts into this directory")
