"""The `compiled-engine` console script."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import kernels
from benchmarks.cli import add_bench_parser
from cli.chat import run_chat
from cli.warmup import add_warmup_parser
from compiled_engine.engine_args import add_engine_args, engine_config
from compiled_engine.models.demo import DEMO_LABEL, DEMO_NAME
from compiled_engine.models.names import resolve_model
from server.args import add_serve_args
from server.batch.offline import add_run_batch_args


def _cmd_demo_model(args: argparse.Namespace) -> int:
    print(resolve_model(DEMO_NAME))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from compiled_engine.llm import LLM
    from compiled_engine.sampling_params import SamplingParams

    config = engine_config(args)
    if config.model == DEMO_NAME:
        print(f"[{DEMO_LABEL}]", file=sys.stderr)
    llm = LLM(**vars(config))
    prompts = [p if args.raw else [{"role": "user", "content": p}] for p in args.prompt]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        print(
            f"prompt: {prompt!r}\noutput: {out.text!r} ({len(out.token_ids)} tokens, "
            f"{out.finish_reason})"
        )
    llm.engine.shutdown()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    # The server is a separate program above this package (imports point down): become it, same pid.
    if args.model is not None:
        resolve_model(args.model)  # a wrong --model fails here, before the server starts
    argv = [sys.executable, "-m", "server", *args.raw_argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached


def _cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from server.batch.offline import run_file

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_file(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo-model", help="create (if missing) and print the path of the demo checkpoint"
    )
    p.set_defaults(func=_cmd_demo_model)

    p = sub.add_parser("generate", help="offline generation: prompts in, text out")
    add_engine_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--raw", action="store_true", help="no chat template: complete the prompt as text"
    )
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "chat", help="interactive chat in the terminal (streams tokens; /reset, /exit)"
    )
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=run_chat)

    p = sub.add_parser("run-batch", help="a Batch API file answered offline (vLLM's run-batch)")
    add_run_batch_args(p)
    p.set_defaults(func=_cmd_run_batch)

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
        # before anything runs torch (an in-process transformers baseline included)
        kernels.apply_isa_caps()
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        if getattr(args, "log_level", None) in ("debug", "trace"):
            traceback.print_exc()
        print(f"compiled-engine {args.command}: error: {e}", file=sys.stderr)  # as argparse's
        return 2


if __name__ == "__main__":
    sys.exit(main())
