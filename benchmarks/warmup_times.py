"""Eager vs cold vs warm start-up, side by side: `python -m benchmarks.warmup_times
[--models smollm2]`.

Each start is a fresh process that builds `LLM(...)` with the engine's defaults and generates one
token. The eager start compiles nothing (`enforce_eager`); a cold start has fresh caches (an empty
compile cache folder and an empty `$COMPILED_ENGINE_CACHE`, so a GGUF file's tokenizer is converted
again too); the warm start reuses what the cold one filled. Reports seconds from process spawn to
ready (engine built) and to the first token, the cache status of each start, and cold and warm as
multiples of eager."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.models import BENCH_NAME, bench_model_dir
from compiled_engine.models.demo import DEMO_NAME
from compiled_engine.models.names import SMOLLM2_NAME
from compiled_engine.runner.buckets import parse_buckets

CHILD = """
import json, logging, sys, time
spawned = float(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams
llm = LLM(**json.loads(sys.argv[2]))
ready = time.time() - spawned
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
print(json.dumps({"ready_s": ready, "first_token_s": time.time() - spawned}))
"""


def start(kwargs: dict, cache_root: Path | None = None) -> dict:
    env = os.environ | ({"COMPILED_ENGINE_CACHE": str(cache_root)} if cache_root else {})
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(time.time()), json.dumps(kwargs)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["status"] = "eager" if kwargs.get("enforce_eager") else next(
        (line.split(":")[0].removeprefix("compile cache ") for line in out.stderr.splitlines()
         if line.startswith("compile cache ")), "?")
    return result


def bench(name: str, kwargs: dict, tmp: Path) -> None:
    """One eager, one cold and one warm start, printed with cold and warm as multiples of eager."""
    eager = start(kwargs | {"enforce_eager": True})
    fresh = tmp / f"{name}-root"
    compiled = kwargs | {"compile_cache_dir": str(fresh / "compile")}
    cold = start(compiled, fresh)
    warm = start(compiled, fresh)
    if warm["status"] != "hit":  # the traced source was edited meanwhile: that start was cold again
        print(
            f"{name:10s} second start was a cache {warm['status']}: source edited meanwhile; once "
            "more",
            flush=True,
        )
        warm = start(compiled, fresh)
    for label, r in (("eager", eager), ("cold", cold), ("warm", warm)):
        print(
            f"{name:10s} {label:5s}: ready {r['ready_s']:6.1f}s  first token "
            f"{r['first_token_s']:6.1f}s  ({r['first_token_s'] / eager['first_token_s']:.1f}x "
            f"eager)  cache {r['status']}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.warmup_times", description=__doc__
    )
    p.add_argument(
        "--models", default=SMOLLM2_NAME, help=f"comma-separated: smollm2, demo, {BENCH_NAME}"
    )
    p.add_argument(
        "--buckets", type=parse_buckets, default=None, help="decode buckets (default: the engine's)"
    )
    p.add_argument("--max-context", type=int, default=2048)
    args = p.parse_args(argv)
    shape = {"max_running": 8, "max_context": args.max_context, "num_pages": 4096}
    if args.buckets:
        shape |= {"buckets": args.buckets, "max_running": max(args.buckets)}
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp:
        for name in args.models.split(","):
            if name in (DEMO_NAME, SMOLLM2_NAME):
                bench(name, shape | {"model": name}, Path(tmp))
            elif name == BENCH_NAME:
                bench(name, shape | {"model": str(bench_model_dir())}, Path(tmp))
            else:
                p.error(f"unknown model {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
