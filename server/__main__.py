"""`python -m server [serve flags]` (what `compiled-engine serve` runs)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import kernels
from compiled_engine.engine_args import engine_config
from compiled_engine.models.tp_fit import check_tp_size
from compiled_engine.ranks.entry import run_rank
from compiled_engine.ranks.rank_spec import RankSpec
from compiled_engine.ranks.torchrun import torchrun_placement
from server.app import batch_store
from server.args import add_serve_args, resolve_api_keys, server_config
from server.serve import refuse, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compiled-engine serve", description="the OpenAI-compatible HTTP server"
    )
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        engine = engine_config(args)
    except ValueError as e:  # a flag's value (e.g. a --kv-cache-dir of another user)
        return refuse(e, args.log_level)
    torchrun = torchrun_placement()
    if torchrun is not None:  # TP across hosts: torchrun's world is the TP group
        if args.tp not in (1, torchrun.world_size):
            print(f"compiled-engine serve: error: --tp {args.tp} under torchrun, whose world is "
                  f"{torchrun.world_size} ranks (the TP group; leave --tp out)", file=sys.stderr)
            return 2
        engine = dataclasses.replace(engine, tp_size=torchrun.world_size)
    try:
        kernels.apply_isa_caps()  # before torch first dispatches; the ranks inherit them
        check_tp_size(engine.model, engine.tp_size)
    # an unknown ISA level, a --tp that does not fit, a model not readable
    except (ValueError, OSError) as e:
        return refuse(e, args.log_level)
    if torchrun is not None and torchrun.rank != 0:  # an engine rank; rank 0 serves HTTP
        run_rank(RankSpec(torchrun.rank, torchrun.world_size, "env://", engine,
                          torchrun.local_rank, torchrun.local_world_size), None)
        return 0
    level = logging.DEBUG if args.log_level in ("debug", "trace") else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        api_keys = resolve_api_keys(args)
    except OSError as e:
        print(f"compiled-engine serve: error: --api-key-file: {e}", file=sys.stderr)
        return 2
    config = server_config(args, engine, api_keys, torchrun)
    try:
        batch_store(config).close()  # another user's folder or a busy one: refused up front
    except OSError as e:
        print(f"compiled-engine serve: error: --batch-dir: {e}", file=sys.stderr)
        return 2
    return serve(config, args.host, args.port, args.log_level)


if __name__ == "__main__":
    sys.exit(main())
