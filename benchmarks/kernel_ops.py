"""Benchmark the kernel ops: `python -m benchmarks.kernel_ops` (CPU ops vs their
portable implementations and the reference), `--linear` (CPU bf16 linear: torch vs pre-packed oneDNN
vs the op), `--lora` (LoRA's delta on the CPU: the native grouped kernel vs the portable code as the
graphs would trace it), `--cuda` (Triton decode bandwidth and extend throughput on a GPU)."""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kernels
from kernels import ops, reference
from kernels.portable import lora as portable_lora


def _paged(
    seq_lens: list[int], num_kv: int, head_dim: int, page_size: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches and a page table whose pages are a random permutation of the pool."""
    pages = [-(-n // page_size) for n in seq_lens]
    order = torch.randperm(sum(pages))
    width = max(pages) * page_size
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    first = 0
    for b, count in enumerate(pages):
        row_pages = order[first : first + count]
        first += count
        table[b] = (row_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    shape = (sum(pages) * page_size, num_kv, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    return k_cache, torch.randn_like(k_cache), table.to(device)


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time after one warm-up call (the machine may be shared: the median resists
    noise)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_cpu(repeats: int) -> None:
    num_heads, num_kv, page_size = 8, 2, 16
    print(
        f"CPU, {torch.get_num_threads()} threads, H={num_heads} Hkv={num_kv} "
        f"page_size={page_size}, median ms"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (128, 64):
            batch, context = 32, 1024
            seq_lens = [context] * batch
            k_cache, v_cache, table = _paged(seq_lens, num_kv, head_dim, page_size, dtype, "cpu")
            q = torch.randn(batch, num_heads, head_dim, dtype=dtype)
            args = (
                q,
                k_cache,
                v_cache,
                table,
                torch.tensor(seq_lens, dtype=torch.int32),
                head_dim**-0.5,
            )
            op = _time_ms(lambda args=args: ops.decode_attention(*args), repeats)
            fallback = _time_ms(
                lambda args=args: torch.ops.kernels.decode_attention_portable(*args), repeats
            )
            ref = _time_ms(lambda args=args: reference.decode_attention_reference(*args), 1)
            print(
                f"decode {str(dtype)[6:]:8} B={batch} ctx={context} D={head_dim}: "
                f"op {op:8.2f}  portable {fallback:8.2f}  reference {ref:9.1f}  ({ref / op:.0f}x)"
            )
    for dtype in (torch.bfloat16, torch.float32):
        for prefix in (0, 512):
            requests, new, head_dim = 4, 512, 128
            seq_lens = [prefix + new] * requests
            k_cache, v_cache, table = _paged(seq_lens, num_kv, head_dim, page_size, dtype, "cpu")
            q = torch.randn(requests * new, num_heads, head_dim, dtype=dtype)
            cu = torch.arange(0, requests + 1, dtype=torch.int32) * new
            lens = torch.tensor(seq_lens, dtype=torch.int32)
            args = (q, k_cache, v_cache, table, cu, lens, head_dim**-0.5)
            op = _time_ms(lambda args=args: ops.extend_attention(*args), repeats)
            ref = _time_ms(lambda args=args: reference.extend_attention_reference(*args), 1)
            print(
                f"extend {str(dtype)[6:]:8} {requests}x{new} prefix={prefix} D={head_dim}: "
                f"op {op:8.2f}  reference {ref:9.1f}  ({ref / op:.0f}x)"
            )


def bench_linear(repeats: int) -> None:
    """The bench model's linears (hidden 768, 12 layers, and the 32000-row LM head; 200 MB of bf16
    weights: decode streams them all every step)."""
    shapes = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(32000, 768)]
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    amx = ops.amx_available()
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    print(
        f"CPU bf16 linear, {torch.get_num_threads()} threads, the bench model's {mib:.0f} MiB of "
        "linears, median ms"
        + ("" if amx else " (no AMX here: the op is oneDNN)")
    )
    for rows in (1, 8, 32, 64, 512):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (768, 2048)}
        plain = _time_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], repeats)
        packed = _time_ms(
            lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, onednn)
            ],
            repeats,
        )
        op = _time_ms(lambda xs=xs: [ops.linear(xs[w.shape[1]], w) for w in weights], repeats)
        print(
            f"rows {rows:4}: torch F.linear {plain:8.2f}  packed oneDNN {packed:8.2f}  op "
            f"{op:8.2f} ({mib / 1024 / op * 1e3:5.1f} GiB/s of weights; {packed / op:.2f}x oneDNN, "
            f"{plain / op:.2f}x torch)"
        )


def bench_lora(repeats: int) -> None:
    """The delta of 8 rank-16 adapters (and the zero slot) on each of the bench model's layer
    linears (qkv, o, gate_up, down: B block-diagonal by projection), the tokens spread over the
    adapters; against the deterministic-mode linear of the same shapes."""
    layer = [(768, (0, 768, 1024, 1280)), (768, (0, 768)), (768, (0, 2048, 4096)), (2048, (0, 768))]
    slots, rank = 9, 16
    torch._dynamo.config.cache_size_limit = 64  # a graph per shape
    traced = torch.compile(portable_lora.lora_delta, dynamic=False)
    print(f"LoRA delta, {torch.get_num_threads()} threads, the bench model's 4 linears of a layer, "
          "8 adapters of rank 16, median ms")
    for tokens in (1, 64, 2048):
        ms = {"native": 0.0, "portable": 0.0, "base": 0.0}
        for k, part_rows in layer:
            width, n = rank * (len(part_rows) - 1), part_rows[-1]
            x = torch.randn(tokens, k).bfloat16()
            a = torch.randn(slots, width, k).bfloat16()
            b = torch.randn(slots, width, n).bfloat16().transpose(1, 2)  # as the linears store it
            ids = torch.arange(tokens) % (slots - 1)
            w = torch.randn(n, k).bfloat16()
            args = (x, a, b, ids, part_rows)
            ms["native"] += _time_ms(
                lambda args=args: torch.ops.kernels.lora_delta.default(*args), repeats)
            ms["portable"] += _time_ms(lambda args=args: traced(*args), repeats)
            ms["base"] += _time_ms(lambda x=x, w=w: ops.linear(x, w, None, True), repeats)
        print(f"tokens {tokens:5}: native {ms['native']:7.2f}  portable traced "
              f"{ms['portable']:7.2f} ({ms['portable'] / ms['native']:.2f}x native)  base linears "
              f"{ms['base']:7.2f} (native delta {ms['native'] / ms['base']:.2f}x of them)")


def bench_cuda() -> None:
    from triton.testing import do_bench

    num_heads, num_kv, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    print(
        f"CUDA {torch.cuda.get_device_name()}, bf16, H={num_heads} Hkv={num_kv} D={head_dim} "
        f"page_size={page_size}"
    )
    for batch, context in (
        (1, 4096),
        (1, 32768),
        (8, 4096),
        (32, 1024),
        (32, 8192),
        (128, 2048),
        (256, 4096),
    ):
        seq_lens = [context] * batch
        k_cache, v_cache, table = _paged(seq_lens, num_kv, head_dim, page_size, dtype, "cuda")
        q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, table, lens, 0.088)
        ms = do_bench(lambda args=args: ops.decode_attention(*args))
        kv_bytes = 2 * sum(seq_lens) * num_kv * head_dim * k_cache.element_size()
        print(
            f"decode B={batch:4} ctx={context:6}: {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e6:7.0f} "
            "GB/s of KV read"
        )
    for requests, new, prefix in ((4, 512, 0), (4, 512, 512), (1, 8192, 0), (16, 1024, 2048)):
        seq_lens = [prefix + new] * requests
        k_cache, v_cache, table = _paged(seq_lens, num_kv, head_dim, page_size, dtype, "cuda")
        q = torch.randn(requests * new, num_heads, head_dim, dtype=dtype, device="cuda")
        cu = torch.arange(0, requests + 1, dtype=torch.int32, device="cuda") * new
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, table, cu, lens, 0.088)
        ms = do_bench(lambda args=args: ops.extend_attention(*args))
        flops = 4 * requests * num_heads * head_dim * new * (prefix + (new + 1) / 2)
        print(
            f"extend {requests}x{new} prefix={prefix}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} "
            "TFLOP/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--cuda", action="store_true", help="benchmark the Triton kernels on the GPU"
    )
    parser.add_argument("--linear", action="store_true", help="benchmark the CPU bf16 linear")
    parser.add_argument("--lora", action="store_true", help="benchmark the CPU LoRA delta")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    kernels.init("cuda" if args.cuda else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cuda:
        bench_cuda()
    elif args.linear:
        bench_linear(args.repeats)
    elif args.lora:
        bench_lora(args.repeats)
    else:
        bench_cpu(args.repeats)


if __name__ == "__main__":
    main()
