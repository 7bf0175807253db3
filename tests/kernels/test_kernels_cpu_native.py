"""The native CPU kernels (kernels/cpu_native.cpp) against the torch fallbacks and fp32 references, and the
fallback when no native library can be built."""

import pytest
import torch
import torch.nn.functional as F
from kernel_batches import make_batch

from kernels import cpu_attention, cpu_native, ops, reference

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: the torch fallback is used")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128])  # 16 and 80 take the generic (non-AVX512) path
@pytest.mark.parametrize(("group", "sliding_window", "soft_cap"), [(1, 0, 0.0), (3, 0, 0.0), (4, 9, 0.0), (2, 0, 4.0)])
def test_decode_matches_torch_fallback(dtype, head_dim, group, sliding_window, soft_cap) -> None:
    seq_lens = [0, 1, 2, 9, 10, 33, 300, 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 2 * group, 2, head_dim, 4, dtype, seed=head_dim + group)
    args = (*batch.decode_args(head_dim**-0.5)[:5], head_dim**-0.5)
    native = cpu_native.decode_attention(*args, sliding_window, soft_cap)
    fallback = cpu_attention.decode_attention_cpu(*args, sliding_window, soft_cap)
    expected = reference.decode_attention_reference(*batch.decode_args(head_dim**-0.5), sliding_window, soft_cap)
    torch.testing.assert_close(native.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(native.float(), fallback.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(native[0], torch.zeros_like(native[0])) and torch.equal(native[-1], torch.zeros_like(native[-1]))


def test_store_kv_rejects_out_of_range_slots_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(6, 2, 4), torch.zeros(6, 2, 4)
    k, v = torch.ones(2, 2, 4), torch.ones(2, 2, 4)
    with pytest.raises(IndexError, match="out of range"):
        ops.store_kv(k_cache, v_cache, k, v, torch.tensor([1, 6]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 2048, 768), (1, 33, 40), (3, 100, 72), (16, 64, 2048), (5, 7, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_fp32_within_bf16_rounding(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = cpu_native.linear_bf16(x, w, b)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, n)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch_error = (F.linear(x, w, b).float() - expected).abs().max()
    assert (out.float() - expected).abs().max() <= max(2 * torch_error, 1e-2 * expected.abs().max())


def test_linear_op_keeps_leading_dims_and_uses_torch_beyond_gemv_rows() -> None:
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(48, 64).bfloat16()
    assert ops.cpu_linear(x, w).shape == (2, 3, 48)
    many = torch.randn(cpu_native.GEMV_MAX_ROWS + 1, 64).bfloat16()
    assert cpu_native.linear_bf16(many, w, None) is None
    assert torch.equal(ops.cpu_linear(many, w), F.linear(many, w))


def test_ops_fall_back_to_torch_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch([5, 40, 0], [1, 1, 1], 4, 2, 64, 4, seed=3)
    with_native = ops.decode_attention(*batch.decode_args(0.125))
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    without = ops.decode_attention(*batch.decode_args(0.125))
    torch.testing.assert_close(without, with_native, atol=2e-5, rtol=2e-5)
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(ops.cpu_linear(x, w), F.linear(x, w))


def test_failed_build_gives_no_library(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cpu_native.library.cache_clear()
    try:
        assert cpu_native.library() is None
    finally:
        monkeypatch.undo()
        cpu_native.library.cache_clear()
    assert cpu_native.library() is not None


def test_store_kv_from_token_strided_views() -> None:
    """K and V sliced out of a fused QKV output are written without a copy, to the right slots."""
    qkv = torch.randn(3, 4 + 2 + 2, 16)  # per token: 4 q heads, 2 k heads, 2 v heads
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    assert cpu_native.store_kv(k_cache, v_cache, k, v, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache[5], k[0]) and torch.equal(k_cache[2], k[2]) and torch.equal(v_cache[2], v[2])
    assert k_cache[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


def test_bf16_linear_layer_compiles_as_one_graph() -> None:
    """The native-GEMV decision is made while tracing, so a bf16 model still compiles without graph breaks."""
    from compiled_engine.layers.linear import linear

    cpu_native.library.cache_clear()  # the first call inside the trace must not be traced into
    w = torch.randn(32, 64).bfloat16()
    fn = torch.compile(lambda x: linear(x, w) * 2, fullgraph=True)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(fn(x), F.linear(x, w) * 2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_whole_row_and_per_head_tasks_agree(dtype: torch.dtype) -> None:
    """Rows >= 2x the threads run one task per row (all KV heads), fewer rows one task per (row, KV head)."""
    batch = make_batch([3, 50, 0, 7, 129, 64], [1] * 6, 8, 4, 64, 1, dtype, seed=7)
    args = (*batch.decode_args(0.125)[:5], 0.125, 0, 0.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 6 rows >= 2 threads' worth: whole rows
        whole_rows = cpu_native.decode_attention(*args)
        torch.set_num_threads(4)  # 6 rows < 8: per KV head
        per_head = cpu_native.decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(whole_rows, per_head, atol=TOL[dtype], rtol=TOL[dtype])
    expected = reference.decode_attention_reference(*batch.decode_args(0.125))
    torch.testing.assert_close(whole_rows.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
