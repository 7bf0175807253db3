"""TP across hosts under torchrun: every process runs one engine rank; rank 0 feeds the requests of
a JSONL file to the rank loop (in place of the launcher's channel) and writes one JSON line per
finished request. torchrun's rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)
places the ranks.

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE --master-addr $HEAD \\
        --master-port 29500 \\
        -m cli.torchrun_entry --model /ckpt --prompts in.jsonl --output out.jsonl

Input lines: {"prompt": "text"} or {"prompt_ids": [1, 2, 3]}, optionally "params": {SamplingParams
fields}. Output lines: {"index", "token_ids", "text", "finish_reason"} (or "error"), in the order
requests finish.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
from typing import TextIO

import kernels
from compiled_engine.engine_args import add_engine_args, engine_config
from compiled_engine.models.names import resolve_model
from compiled_engine.ranks.messages import Add, RequestError, Shutdown
from compiled_engine.ranks.rank_loop import serve_rank
from compiled_engine.ranks.rank_spec import RankSpec
from compiled_engine.ranks.torchrun import torchrun_placement
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import TokenEvent
from compiled_engine.tokenization import encode_prompt, load_tokenizer


class JsonlChannel:
    """Rank 0's stand-in for the launcher's Connection: hands out every request, collects the
    events, and asks the ranks to stop once every request has finished."""

    def __init__(self, requests: list[Add], tokenizer, out: TextIO) -> None:
        self._inbox: collections.deque = collections.deque(requests or [Shutdown()])
        self._tokens: dict[str, list[int]] = {req.rid: [] for req in requests}
        self._tokenizer, self._out = tokenizer, out

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self._inbox)

    def recv(self) -> object:
        return self._inbox.popleft()

    def send(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, TokenEvent) and ev.rid in self._tokens:
                if ev.token is not None:
                    self._tokens[ev.rid].append(ev.token)
                if ev.finished:
                    ids = self._tokens.pop(ev.rid)
                    self._write(
                        {
                            "index": int(ev.rid),
                            "token_ids": ids,
                            "finish_reason": ev.finish_reason,
                            "text": self._tokenizer.decode(ids, skip_special_tokens=True),
                        }
                    )
            elif isinstance(ev, RequestError) and ev.rid in self._tokens:
                del self._tokens[ev.rid]
                self._write({"index": int(ev.rid), "error": ev.message})
        if not self._tokens and not self._inbox:
            self._inbox.append(Shutdown())

    def _write(self, line: dict) -> None:
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()


def read_requests(path: str, tokenizer, defaults: SamplingParams) -> list[Add]:
    requests = []
    with open(path) as f:
        for i, line in enumerate(x for x in f if x.strip()):
            item = json.loads(line)
            ids = (
                item["prompt_ids"]
                if "prompt_ids" in item
                else encode_prompt(tokenizer, item["prompt"])
            )
            requests.append(
                Add(str(i), ids, dataclasses.replace(defaults, **item.get("params", {})))
            )
    return requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.torchrun_entry",
                                     description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--prompts", required=True, help="JSONL requests (read on rank 0)")
    parser.add_argument(
        "--output", default="-", help="JSONL results written by rank 0 (- for stdout)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    kernels.apply_isa_caps()  # before the process group's first tensor
    place = torchrun_placement()
    if place is None:
        parser.error("run me under torchrun (see --help)")
    rank, world = place.rank, place.world_size
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    config = dataclasses.replace(engine_config(args), tp_size=world)
    spec = RankSpec(rank, world, "env://", config, place.local_rank, place.local_world_size)
    if rank != 0:
        serve_rank(spec, None)
        return 0
    tokenizer = load_tokenizer(resolve_model(args.model))
    defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    requests = read_requests(args.prompts, tokenizer, defaults)
    # closed below
    out = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    try:
        serve_rank(spec, JsonlChannel(requests, tokenizer, out))
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
