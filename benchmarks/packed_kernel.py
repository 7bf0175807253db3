"""The packed linear alone, per format: the weight in the file's layout, 16 rows interleaved (what
the loader makes on a bf16 CPU), and the bf16 weight through deterministic mode's linear, on random
blocks; best of 5 batches of calls, microseconds per call. Not part of CI:

    .venv/bin/python -m benchmarks.packed_kernel
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import kernels
from kernels import ops
from kernels.interleave import interleave, interleaved_format
from kernels.packed import FORMATS, PackedWeight

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_weight(name: str, n: int, k: int) -> PackedWeight:
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, size=(n, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scale = rng.uniform(-0.01, 0.01, size=(n, k // fmt.block, 1)).astype(np.float16)
        b[..., at : at + 2] = scale.view(np.uint8)
    return PackedWeight(torch.from_numpy(b.reshape(n, -1)), fmt, k)


def best_us(f, calls: int) -> float:
    f()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,128", help="activation rows, comma separated")
    parser.add_argument("--formats", default="Q4_1,Q8_0,Q5_0,Q4_K,Q6_K")
    args = parser.parse_args()
    rows = [int(m) for m in args.m.split(",")]
    kernels.init("cpu")
    print("| format | N x K | M | file layout us | 16 rows interleaved us | bf16 (deterministic) us"
          " |")
    print("|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        for n, k in ((1536, 768), (49152, 768)):
            w = random_weight(name, n, k)
            x16 = PackedWeight(interleave(w.blocks, w.format), interleaved_format(w.format), k)
            dense = w.dequantize().bfloat16()
            for m in rows if n < 10000 else [m for m in rows if m <= 16]:
                x = torch.randn(m, k).bfloat16()
                calls = 200 if m <= 16 and n < 10000 else 10
                times = [best_us(lambda x=x, w=w: ops.linear(x, w), calls),
                         best_us(lambda x=x, w=x16: ops.linear(x, w), calls),
                         best_us(lambda x=x, w=dense: ops.linear(x, w, None, True), calls)]
                cells = " | ".join(f"{t:.0f}" for t in times)
                print(f"| {name} | {n} x {k} | {m} | {cells} |")


if __name__ == "__main__":
    main()
