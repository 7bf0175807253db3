"""The CPU fused MoE op (tokens sorted by expert, one `kernels::linear` per projection per expert)
against torch's grouped GEMM (`torch._grouped_mm`, one call per projection) on the `qwen3-moe` bench
model's expert shapes in bf16 (8 experts, hidden 576, intermediate 768, top-2), both timed in this
process, alternating (docs/benchmarks.md, "Qwen3-MoE")."""

import time

import torch
import torch.nn.functional as F

from kernels import ops
from kernels.portable.moe import combine

EXPERTS, HIDDEN, INTER, TOP_K = 8, 576, 768, 2


def grouped(x, w13_t, w2_t, weights, ids) -> torch.Tensor:
    """The same MLP through torch._grouped_mm (weights [E, K, N]; each expert's rows ending at
    its offset)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
    rows = x.index_select(0, order // TOP_K)
    gate, up = torch._grouped_mm(rows, w13_t, offs=offsets).chunk(2, -1)
    rows = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2_t, offs=offsets)
    out = torch.empty_like(rows)
    out[order] = rows
    return combine(out, weights)


def best_ms(fn, args: tuple, calls: int) -> float:
    for _ in range(3):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ops.load_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / 20).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 20).bfloat16()
    w13_t, w2_t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    print("| tokens | fused_moe (per-expert kernels::linear) ms | torch._grouped_mm ms | ratio | "
          "max diff |")
    print("|---|---|---|---|---|")
    for tokens in (1, 8, 32, 256):
        x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1)
        ours, theirs = (ops.fused_moe, (x, w13, w2, weights, ids)), (grouped,
                                                                   (x, w13_t, w2_t, weights, ids))
        diff = (ours[0](*ours[1]).float() - theirs[0](*theirs[1]).float()).abs().max().item()
        calls = 200 if tokens <= 32 else 20
        times = {"ours": [], "theirs": []}
        for _ in range(2):  # alternating rounds, each side keeps its best
            times["ours"].append(best_ms(*ours, calls))
            times["theirs"].append(best_ms(*theirs, calls))
        a, b = min(times["ours"]), min(times["theirs"])
        print(f"| {tokens} | {a:.3f} | {b:.3f} | {b / a:.2f}x | {diff:.3g} |")


if __name__ == "__main__":
    main()
