"""The `compiled-engine` console script."""

from __future__ import annotations

import argparse
import sys

from compiled_engine.demo_model import DEMO_LABEL, DEMO_NAME, resolve_model


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEMO_NAME,
        help=f"local Hugging Face checkpoint directory, or 'demo' (default): the {DEMO_LABEL}",
    )


def _cmd_demo_model(args: argparse.Namespace) -> int:
    print(resolve_model(DEMO_NAME))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from compiled_engine.reference_generate import generate_text

    path = resolve_model(args.model)
    if args.model == DEMO_NAME:
        print(f"[{DEMO_LABEL}]", file=sys.stderr)
    for prompt in args.prompt:
        text = generate_text(path, prompt, max_tokens=args.max_tokens, chat=not args.raw)
        print(f"prompt: {prompt!r}\noutput: {text!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="create (if missing) and print the path of the demo checkpoint")
    p.set_defaults(func=_cmd_demo_model)

    p = sub.add_parser("generate", help="offline generation: prompts in, text out")
    _add_model_arg(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--raw", action="store_true", help="no chat template: complete the prompt as text")
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "prompt", ()) is None:
        args.prompt = ["Hello! What can a serving engine do?"]
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
