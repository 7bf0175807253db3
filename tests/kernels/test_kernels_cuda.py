"""The Triton kernels compiled for CUDA, at realistic shapes, against the reference (GPU machines
only): fp32 and the tensor cores' fp16 / bf16, head dims 64-256, GQA groups 1-16, split-K and
deterministic mode."""

import os

import pytest
import torch

from kernels import ops, reference
from tests.helpers.kernel_batches import PagedBatch, make_batch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 would interpret the CUDA kernels",
    ),
]

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cuda(batch: PagedBatch) -> PagedBatch:
    moved = {
        name: value.cuda() for name, value in vars(batch).items() if isinstance(value, torch.Tensor)
    }
    return PagedBatch(**moved, page_size=batch.page_size)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(dtype: torch.dtype, head_dim: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens = [*torch.randint(1, 2049, (12,), generator=gen).tolist(), 1, 16, 17, 4096, 0, 0]
    batch = make_batch(
        seq_lens, [1] * len(seq_lens), 8, 2, head_dim, page_size, dtype, extra_width=64
    )
    args = batch.decode_args(head_dim**-0.5)
    _close(
        ops.decode_attention(*_cuda(batch).decode_args(head_dim**-0.5)),
        reference.decode_attention_reference(*args),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 8, 16])
@pytest.mark.parametrize("invariant", [False, True])
def test_decode_gqa(dtype: torch.dtype, group: int, invariant: bool) -> None:
    """Grouped-query decode on the tensor cores, split-K (default) and one split (deterministic
    mode)."""
    seq_lens = [1, 100, 2048, 513, 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 2 * group, 2, 128, 16, dtype, seed=group)
    args = batch.decode_args(128**-0.5)
    actual = ops.decode_attention(*_cuda(batch).decode_args(128**-0.5), 0, 0.0, invariant)
    _close(actual, reference.decode_attention_reference(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 500])
@pytest.mark.parametrize("group", [1, 4, 16])
def test_extend(dtype: torch.dtype, prefix: int, group: int) -> None:
    q_lens = [300, 1, 65, 128, 0]
    seq_lens = [q + prefix for q in q_lens]
    batch = make_batch(seq_lens, q_lens, 2 * group, 2, 128, 16, dtype, seed=prefix)
    args = batch.extend_args(128**-0.5)
    expected = reference.extend_attention_reference(*args)
    _close(ops.extend_attention(*_cuda(batch).extend_args(128**-0.5)), expected)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("invariant", [False, True])
def test_extend_head_dims(head_dim: int, invariant: bool) -> None:
    q_lens = [200, 1, 33]
    batch = make_batch(
        [q + 40 for q in q_lens], q_lens, 8, 2, head_dim, 16, torch.bfloat16, seed=head_dim
    )
    expected = reference.extend_attention_reference(*batch.extend_args(head_dim**-0.5))
    _close(
        ops.extend_attention(*_cuda(batch).extend_args(head_dim**-0.5), 0, 0.0, invariant), expected
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Deterministic mode on the GPU: a row's linear and decode output is bitwise the same alone as
    in a batch of 37 (cuBLAS and split-K would pick by the shape)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1024, generator=gen).to(dtype).cuda()
    w = torch.randn(3072, 1024, generator=gen).to(dtype).cuda()
    full = ops.linear(x, w, invariant=True)
    for i in (0, 5, 36):
        assert torch.equal(ops.linear(x[i : i + 1], w, invariant=True), full[i : i + 1])
    torch.testing.assert_close(
        full.float(),
        (x.float() @ w.float().T),
        atol=0.05 if dtype == torch.bfloat16 else 1e-3,
        rtol=2e-2,
    )
    seq_lens = [7, 1000, 64, 2048, 300]
    batch = _cuda(make_batch(seq_lens, [1] * 5, 16, 8, 128, 16, dtype))
    args = batch.decode_args(0.1)
    full = ops.decode_attention(*args, 0, 0.0, True)
    q, k_cache, v_cache, page_table, lens, scale = args
    for i in range(5):
        alone = ops.decode_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            page_table[i : i + 1],
            lens[i : i + 1],
            scale,
            0,
            0.0,
            True,
        )
        assert torch.equal(alone, full[i : i + 1])


@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(128, 0.0), (0, 30.0), (1000, 50.0)])
def test_window_and_soft_cap(sliding_window: int, soft_cap: float) -> None:
    seq_lens = [100, 129, 3000, 1]
    batch = make_batch(seq_lens, [1] * 4, 8, 2, 128, 16, torch.bfloat16)
    args = (*batch.decode_args(0.1), sliding_window, soft_cap)
    actual = ops.decode_attention(*_cuda(batch).decode_args(0.1), sliding_window, soft_cap)
    _close(actual, reference.decode_attention_reference(*args))
    batch = make_batch(seq_lens, [100, 60, 200, 1], 8, 2, 128, 16, torch.bfloat16)
    args = (*batch.extend_args(0.1), sliding_window, soft_cap)
    actual = ops.extend_attention(*_cuda(batch).extend_args(0.1), sliding_window, soft_cap)
    _close(actual, reference.extend_attention_reference(*args))


def test_store_kv() -> None:
    k_cache = torch.zeros(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn_like(k_cache[:300]), torch.randn_like(k_cache[:300])
    slots = torch.randperm(4096, device="cuda")[:300]
    slots[::7] = -1
    expected_k, expected_v = k_cache.cpu(), v_cache.cpu()
    reference.store_kv_reference(expected_k, expected_v, k.cpu(), v.cpu(), slots.cpu())
    ops.store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


def test_decode_replays_in_a_cuda_graph() -> None:
    """No host reads: a captured decode step follows new lengths written into its input tensors."""
    # Row 0 owns 48 slots and is captured at 40, so that its replay at 41 reads only slots it owns.
    batch = _cuda(make_batch([48, 300, 1000, 7], [1] * 4, 8, 2, 128, 16, torch.bfloat16))
    batch.seq_lens.copy_(torch.tensor([40, 300, 1000, 7], device="cuda"))
    args = batch.decode_args(0.1)
    ops.decode_attention(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(*args)
    batch.seq_lens.copy_(torch.tensor([41, 1, 999, 0], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference.decode_attention_reference(
        *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    )
    _close(out, expected)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q5_0", "Q4_K"])
def test_packed_linear(name: str) -> None:
    """`ops.linear` on a packed weight on CUDA, bf16 activations (the Triton kernel for blocks of
    32; Q4_K the portable path) against fp32 on the dequantized weight, and, in deterministic mode,
    rows independent of the batch."""
    from tests.helpers.packed_weights import packed

    w = packed(name, 1536, 768)
    x = torch.randn(37, 768).bfloat16()
    exact = torch.nn.functional.linear(x.float(), w.dequantize())
    w.cuda()
    got = ops.linear(x.cuda(), w, invariant=True)
    _close(got, exact.bfloat16())
    assert torch.equal(ops.linear(x[:5].cuda(), w, invariant=True), got[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_is_each_tokens_product_and_batch_invariant(dtype: torch.dtype) -> None:
    """The LoRA op on CUDA (Triton) at a 4096-wide model's qkv shapes (q 4096, k and v 1024, rank 16
    each, 8 adapters): each token's product, and the same bits alone as among 300 tokens."""
    gen = torch.Generator().manual_seed(0)
    k, rank, part_rows, slots_n = 4096, 16, (0, 4096, 5120, 6144), 8
    x = torch.randn(300, k, generator=gen).to(dtype)
    a = (torch.randn(slots_n + 1, 3 * rank, k, generator=gen) / k**0.5).to(dtype)
    b = torch.zeros(slots_n + 1, part_rows[-1], 3 * rank)
    for p, (lo, hi) in enumerate(zip(part_rows, part_rows[1:])):
        b[:, lo:hi, p * rank:(p + 1) * rank] = torch.randn(slots_n + 1, hi - lo, rank,
                                                           generator=gen) / rank**0.5
    a[-1], b[-1] = 0, 0
    b = b.to(dtype)
    slots = torch.randint(-1, slots_n, (300,), generator=gen)
    got = ops.lora_delta(x.cuda(), a.cuda(), b.cuda(), slots.cuda(), part_rows)
    want = torch.stack([b[s].float() @ (a[s].float() @ x[t].float())
                        for t, s in enumerate(slots.tolist())])
    _close(got, want.to(dtype))
    alone = ops.lora_delta(x[7:8].cuda(), a.cuda(), b.cuda(), slots[7:8].cuda(), part_rows)
    assert torch.equal(alone, got[7:8])
