"""Cold vs warm start-up through the compile cache: `python -m compiled_engine.warmup_bench`.

Each start is a fresh process that builds `LLM(...)` and generates one token; a cold start uses an
empty cache folder, the warm start the folder the cold one filled. Reports seconds from process spawn
to ready (engine built) and to the first token, and the cache status of each start."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compiled_engine.demo_model import DEMO_CONFIG, DEMO_NAME, demo_model_dir
from compiled_engine.runner.buckets import parse_buckets

# A larger random Llama (about 110M parameters), with the demo tokenizer's files.
LLAMA_768 = DEMO_CONFIG | {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                           "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000}

CHILD = """
import json, logging, sys, time
spawned = float(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
from compiled_engine.llm import LLM
from compiled_engine.scheduler.sampling_params import SamplingParams
llm = LLM(**json.loads(sys.argv[2]))
ready = time.time() - spawned
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
print(json.dumps({"ready_s": ready, "first_token_s": time.time() - spawned}))
"""


def start(kwargs: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(time.time()), json.dumps(kwargs)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["status"] = next((line.split(":")[0].removeprefix("compile cache ") for line in out.stderr.splitlines()
                             if line.startswith("compile cache ")), "?")
    return result


def bench(name: str, kwargs: dict, cache: Path) -> None:
    kwargs = kwargs | {"compile_cache_dir": str(cache)}
    cold = start(kwargs)
    warm = start(kwargs)
    if warm["status"] != "hit":  # the traced source was edited meanwhile: that start was cold again
        print(f"{name:10s} second start was a cache {warm['status']}: source edited meanwhile; once more", flush=True)
        warm = start(kwargs)
    for label, r in (("cold", cold), ("warm", warm)):
        print(f"{name:10s} {label}: ready {r['ready_s']:6.1f}s  first token {r['first_token_s']:6.1f}s  "
              f"cache {r['status']}", flush=True)
    print(f"{name:10s} warm is {cold['ready_s'] / warm['ready_s']:.1f}x faster to ready, "
          f"{cold['first_token_s'] / warm['first_token_s']:.1f}x to first token", flush=True)


def llama_768_dir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in demo_model_dir().iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(LLAMA_768, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compiled_engine.warmup_bench", description=__doc__)
    p.add_argument("--models", default="demo", help="comma-separated: demo, llama-768")
    p.add_argument("--buckets", type=parse_buckets, default=[1, 2, 4, 8])
    p.add_argument("--max-context", type=int, default=512)
    args = p.parse_args(argv)
    shape = {"buckets": args.buckets, "max_running": max(args.buckets), "max_context": args.max_context,
             "num_pages": 4096}
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp:
        for name in args.models.split(","):
            if name == "demo":
                bench(name, shape | {"model": DEMO_NAME}, Path(tmp) / name)
            elif name == "llama-768":
                model = str(llama_768_dir(Path(tmp) / "llama-768-model"))
                bench(name, shape | {"model": model, "load_format": "dummy"}, Path(tmp) / name)
            else:
                p.error(f"unknown model {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
