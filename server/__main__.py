"""`python -m server [serve flags]` (what `compiled-engine serve` runs)."""

from __future__ import annotations

import argparse
import logging
import sys

from compiled_engine.engine_args import engine_config
from server.args import add_serve_args
from server.serve import serve
from server.state import ServerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compiled-engine serve", description="the OpenAI-compatible HTTP server")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(engine=engine_config(args), api_key=args.api_key, max_queue=args.max_queue, debug=args.debug,
                          tool_call_parser=args.tool_call_parser)
    return serve(config, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
