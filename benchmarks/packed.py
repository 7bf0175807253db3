"""A GGUF file's weights kept packed vs dequantized to bf16 (`--quantization none`), in our engine:
512-token prefill and batch-1 greedy decode (128 tokens after a 128-token prompt), best of
`--rounds`, the weights' bytes and the process RSS. One mode per process; alternate them for an A/B:

    for m in packed none packed none; do .venv/bin/python -m benchmarks.packed $m; done
"""

from __future__ import annotations

import argparse
import json
import time

from compiled_engine import LLM, SamplingParams
from compiled_engine.models.loader import weight_bytes
from compiled_engine.models.names import smollm2_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("packed", "none"))
    ap.add_argument("--model", default=None, help="a GGUF file (default: the wheel's SmolLM2)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model or str(smollm2_path()), max_running=4, num_pages=4096,
              prefix_cache="naive", quantization=None if args.mode == "packed" else "none")
    ids = [(i * 37) % 40000 + 100 for i in range(512)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    llm.generate([ids[:128]], one)
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for _ in range(args.rounds):
        t = time.perf_counter()
        llm.generate([ids], one)
        prefill = 512 / (time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([ids[:128]], one)
        first = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([ids[:128]], decode)
        tok_s = 128 / (time.perf_counter() - t - first)
        best = {"prefill_tok_s": max(prefill, best["prefill_tok_s"]),
                "decode_tok_s": max(tok_s, best["decode_tok_s"])}
    with open("/proc/self/status") as f:
        rss = int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024
    print(json.dumps({"mode": args.mode, **best,
                      "weight_mb": weight_bytes(llm.engine.model) / 2**20, "rss_mb": rss}))


if __name__ == "__main__":
    main()
