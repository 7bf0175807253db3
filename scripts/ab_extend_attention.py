"""Time two versions of kernels/cpu/native/extend_attention.cpp side by side, in one process.

    src=kernels/cpu/native/extend_attention.cpp
    git show HEAD~1:$src > /tmp/old.cpp
    .venv/bin/python scripts/ab_extend_attention.py /tmp/old.cpp $src

Each source is built `--copies` times (separate libraries, so separate buffer addresses) and the
calls of all builds alternate, per call, on the bench model's attention shapes (12 heads, 4 KV
heads, D 64) and one D 128 case. Printed per case: the median call time of each version (geometric
mean over its copies) and the ratio new / old. Timing the builds alternately cancels the drift of a
shared machine, and the copies expose layout effects (the same build, other addresses) that would
otherwise read as a difference between versions.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kernels import ops  # noqa: E402
from kernels.cpu import build as native_build  # noqa: E402
from tests.helpers.kernel_batches import PagedBatch, make_batch  # noqa: E402

P, I64 = ctypes.c_void_p, ctypes.c_int64


def build(source: Path, out: Path) -> ctypes.CDLL:
    """`source` alone (it needs no torch headers) with the native library's flags."""
    subprocess.run(
        ["g++", *native_build.FLAGS, f"-I{native_build.NATIVE}", str(source), "-o", str(out)],
        check=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.ce_extend_attention_bf16.argtypes = [
        P,
        I64,
        P,
        P,
        P,
        I64,
        P,
        P,
        P,
        I64,
        I64,
        I64,
        I64,
        I64,
        ctypes.c_float,
    ]
    lib.ce_extend_attention_bf16.restype = ctypes.c_int
    return lib


def shared_prefix(requests: int, prefix: int, suffix: int) -> PagedBatch:
    batch = make_batch(
        [prefix + suffix] * requests, [suffix] * requests, 12, 4, 64, 1, torch.bfloat16
    )
    batch.page_table[1:, :prefix] = batch.page_table[0, :prefix]
    return batch


def cases() -> dict[str, tuple[PagedBatch, int]]:
    fresh = lambda lens, heads=12, dim=64: make_batch(lens, lens, heads, 4, dim, 1, torch.bfloat16)  # noqa: E731
    return {
        "fresh 1056": (fresh([1056]), 60),
        "19 x 38 over 1024": (shared_prefix(19, 1024, 38), 60),
        "39 x 38 over 1024": (shared_prefix(39, 1024, 38), 40),
        "fresh 4096": (fresh([4096]), 10),
        "8 x fresh 1056": (fresh([1056] * 8), 10),
        "fresh 1024, D 128": (fresh([1024], 16, 128), 30),
    }


def time_case(libs: list[ctypes.CDLL], batch: PagedBatch, calls: int) -> tuple[list[float], float]:
    """Median ms per call of each library (calls alternating, rotating the order), and the largest
    output difference between the first and the last library."""
    q = batch.q.contiguous()
    heads, dim = q.shape[1], q.shape[2]
    table, cu, lens = (
        t.to(torch.int32).contiguous() for t in (batch.page_table, batch.cu_q_lens, batch.seq_lens)
    )
    outs = [torch.empty_like(q) for _ in libs]

    def call(i: int) -> None:
        bad = libs[i].ce_extend_attention_bf16(
            q.data_ptr(),
            q.stride(0),
            batch.k_cache.data_ptr(),
            batch.v_cache.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            cu.data_ptr(),
            lens.data_ptr(),
            outs[i].data_ptr(),
            lens.numel(),
            heads,
            batch.k_cache.shape[1],
            dim,
            batch.k_cache.shape[0],
            dim**-0.5,
        )
        assert bad == 0, "the kernel declined the case"

    for i in range(len(libs)):
        call(i)
    times: list[list[float]] = [[] for _ in libs]
    order = list(range(len(libs)))
    for n in range(calls):
        for i in order[n % len(libs):] + order[: n % len(libs)]:
            start = time.perf_counter()
            call(i)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times], (
        outs[0].float() - outs[-1].float()
    ).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--copies", type=int, default=3)
    args = parser.parse_args()
    if not ops.amx_available():  # also asks Linux for the AMX tile state
        print("no AMX bf16 here: the extend kernel is not built")
        return 1
    torch.set_num_threads(2)
    sources = [args.old] * args.copies + [args.new] * args.copies
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(src, Path(tmp) / f"{i}.so") for i, src in enumerate(sources)]
        for name, (batch, calls) in cases().items():
            medians, diff = time_case(libs, batch, calls)
            old = statistics.geometric_mean(medians[: args.copies])
            new = statistics.geometric_mean(medians[args.copies :])
            print(
                f"{name:18s} old {old:7.2f} ms  new {new:7.2f} ms  new/old {new / old:.3f}  "
                f"(copies {' '.join(f'{m:.2f}' for m in medians)})  max |new - old| {diff:.4f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
