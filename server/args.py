"""The server's command-line flags (`compiled-engine serve`, `python -m server`)."""

from __future__ import annotations

import argparse

from compiled_engine.engine_args import add_engine_args
from compiled_engine.sampling_params import POOLINGS
from server.tools import PARSERS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)"
    )
    p.add_argument("--max-queue", type=int, default=1024, help="sequences in flight before 429")
    p.add_argument("--debug", action="store_true", help="expose GET /debug/integrity")
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default="last",
        help="how /v1/embeddings pools the final hidden states: the last token's, or the mean",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="the format of the model's tool calls (default: read from its chat template)",
    )
