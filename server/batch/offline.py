"""`compiled-engine run-batch -i in.jsonl -o out.jsonl` (vLLM's `run-batch`): a batch file run
offline through the server's own handlers, in this process, without a socket: the engine starts,
every line is answered (`--batch-concurrency` at once), each answer a line of the output file as it
comes (errors too, with their status: vLLM writes one file), then the engine stops. The file is
checked first, as the Batch API checks it; lines may name any of its endpoints. The app's Batch API
store is a temporary folder: a server's store (and its batches) is never touched."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from server.app import BATCH_HANDLERS, create_app
from server.args import add_serve_args, server_config
from server.batch.lines import check_file, lines
from server.batch.runner import answer_line, in_process


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    add_serve_args(p)
    p.add_argument("-i", "--input-file", required=True, help="the batch's JSONL file")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL)")
    p.add_argument("--batch-concurrency", type=int, default=32,
                   help="requests in flight at once")


async def run_file(args: argparse.Namespace) -> int:
    from compiled_engine.engine_args import engine_config

    config = server_config(args, engine_config(args))
    source = Path(args.input_file)
    count, errors = await asyncio.to_thread(check_file, source, None, config.max_body_bytes)
    if errors:
        for e in errors:
            print(f"run-batch: {e['message']}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="compiled-engine-run-batch-") as store:
        app = create_app(dataclasses.replace(config, batch_dir=store))
        return await _answer_all(app, args, config, source, count)


async def _answer_all(app, args: argparse.Namespace, config, source: Path, count: int) -> int:
    """Every line of `source` answered into the output file through `app`'s handlers."""
    async with app.router.lifespan_context(app):
        start = time.perf_counter()
        execute = in_process(app, BATCH_HANDLERS)
        slots = asyncio.Semaphore(args.batch_concurrency)
        failed = 0

        with open(args.output_file, "wb") as out:
            async def one(line) -> None:
                nonlocal failed
                status, body = await execute(line.url, line.body)
                failed += status >= 400
                out.write(answer_line(line.custom_id, status, body) + b"\n")

            running: set[asyncio.Task] = set()
            todo = lines(source, None, config.max_body_bytes)
            while (line := await asyncio.to_thread(next, todo, None)) is not None:
                await slots.acquire()  # read on only as answers make room
                task = asyncio.create_task(one(line))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), slots.release()))
            failures = [e for e in await asyncio.gather(*running, return_exceptions=True)
                        if isinstance(e, BaseException)]
            if failures:  # every other answer is written before the first failure is raised
                raise failures[0]
        seconds = time.perf_counter() - start
    print(f"run-batch: {count} requests, {failed} failed, into {args.output_file}; answered in "
          f"{seconds:.2f} s", file=sys.stderr)
    return 0
