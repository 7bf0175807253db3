"""The native CPU kernels (kernels/cpu/native/*.cpp, through the kernels:: ops) against the portable
torch implementations and fp32 references, and the portable path when no native library can be
built."""

import pytest
import torch

from kernels import ops, reference
from kernels.cpu import build
from kernels.portable import attention as portable_attention
from tests.helpers.kernel_batches import make_batch

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(
    not ops.load_cpu_kernels(), reason="no C++ compiler: the portable ops serve the CPU"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 16 and 80 take the generic (non-AVX512) path
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize(
    ("group", "sliding_window", "soft_cap"), [(1, 0, 0.0), (3, 0, 0.0), (4, 9, 0.0), (2, 0, 4.0)]
)
def test_decode_matches_torch_fallback(dtype, head_dim, group, sliding_window, soft_cap) -> None:
    seq_lens = [0, 1, 2, 9, 10, 33, 300, 0]
    batch = make_batch(
        seq_lens, [1] * len(seq_lens), 2 * group, 2, head_dim, 4, dtype, seed=head_dim + group
    )
    args = (*batch.decode_args(head_dim**-0.5)[:5], head_dim**-0.5)
    # the C++ kernel
    native = ops.decode_attention(*batch.decode_args(head_dim**-0.5), sliding_window, soft_cap)
    fallback = portable_attention.decode_attention(*args, sliding_window, soft_cap)
    expected = reference.decode_attention_reference(
        *batch.decode_args(head_dim**-0.5), sliding_window, soft_cap
    )
    torch.testing.assert_close(native.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(native.float(), fallback.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(native[0], torch.zeros_like(native[0])) and torch.equal(
        native[-1], torch.zeros_like(native[-1])
    )


amx_only = pytest.mark.skipif(not ops.amx_available(), reason="no AMX bf16 on this CPU / build")


@amx_only
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (64, 1), (128, 4), (256, 2)])
def test_decode_rows_sharing_cached_prefixes_match_reference(head_dim: int, group: int) -> None:
    """Two groups of rows sharing 300 and 700 leading slots (radix hits), tails of 0 to 200 own
    keys, and a padding row: the op's shared-prefix path (every row shares >= 256 keys with another)
    against fp32."""
    tails = [0, 1, 37, 64, 200, 5, 90]
    seq_lens = [300 + t for t in tails[:3]] + [700 + t for t in tails[3:]] + [0]
    batch = make_batch(
        seq_lens, [1] * len(seq_lens), 2 * group, 2, head_dim, 1, torch.bfloat16, seed=group
    )
    batch.page_table[1:3, :300] = batch.page_table[0, :300]
    batch.page_table[4:7, :700] = batch.page_table[3, :700]
    scale = head_dim**-0.5
    native = ops.decode_attention(*batch.decode_args(scale))
    expected = reference.decode_attention_reference(*batch.decode_args(scale))
    torch.testing.assert_close(native.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(native[-1], torch.zeros_like(native[-1]))


@amx_only
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (64, 3), (128, 4), (256, 2)])
def test_extend_matches_reference(head_dim: int, group: int) -> None:
    # fresh prompts, cached prefixes, a row past 128 query rows of a group (two work items), a
    # decode-like one-token extend, an empty extend, and key counts on and off the 64-key blocks
    seq_lens = [1, 70, 64, 200, 33, 0, 129]
    q_lens = [1, 70, 5, 150, 1, 0, 64]
    batch = make_batch(
        seq_lens, q_lens, 2 * group, 2, head_dim, 16, torch.bfloat16, seed=head_dim + group
    )
    scale = head_dim**-0.5
    native = ops.extend_attention(*batch.extend_args(scale))  # the C++ kernel
    expected = reference.extend_attention_reference(*batch.extend_args(scale))
    fallback = portable_attention.extend_attention(*batch.extend_args(scale)[:6], scale)
    torch.testing.assert_close(native.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(native.float(), fallback.float(), atol=2e-2, rtol=2e-2)


@amx_only
def test_extend_requests_sharing_cached_blocks() -> None:
    """Rows 1 and 2 reuse row 0's first 70 slots (a radix hit: block 0 shared, block 1 not), row 3
    all of row 0's slots; the kernel packs shared blocks once."""
    batch = make_batch([150, 150, 90, 150], [40, 30, 20, 5], 6, 2, 64, 1, torch.bfloat16, seed=11)
    batch.page_table[1:3, :70] = batch.page_table[0, :70]
    batch.page_table[3] = batch.page_table[0]
    native = ops.extend_attention(*batch.extend_args(0.125))
    expected = reference.extend_attention_reference(*batch.extend_args(0.125))
    torch.testing.assert_close(native.float(), expected.float(), atol=2e-2, rtol=2e-2)


@amx_only
@pytest.mark.parametrize("seed", range(8))
def test_extend_random_batches_match_reference(seed: int) -> None:
    """Random ragged batches: lengths on and off the 64-key blocks and 16-row tiles, GQA groups 1-4,
    head sizes 64 and 128, and rows that reuse a random-length prefix of another row's slots (radix
    hits)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    rows, group, head_dim = rand(1, 6), rand(1, 4), (64, 128)[seed % 2]
    seq_lens = [rand(1, 300) for _ in range(rows)]
    q_lens = [rand(1, n) for n in seq_lens]
    batch = make_batch(seq_lens, q_lens, 2 * group, 2, head_dim, 1, torch.bfloat16, seed=seed)
    for b in range(1, rows):
        src = rand(0, b - 1)
        shared = min(rand(0, seq_lens[src]), seq_lens[b] - q_lens[b])  # cached positions only
        batch.page_table[b, :shared] = batch.page_table[src, :shared]
    scale = head_dim**-0.5
    native = ops.extend_attention(*batch.extend_args(scale))
    expected = reference.extend_attention_reference(*batch.extend_args(scale))
    torch.testing.assert_close(native.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("invariant", [False, True])
def test_extend_zeroes_rows_of_no_request_and_reads_strided_queries(invariant: bool) -> None:
    """Every native route (the AMX kernel, decode rows on AVX512, the invariant routine, the
    portable op)."""
    batch = make_batch([40, 9], [40, 3], 4, 2, 64, 1, torch.bfloat16, seed=7)
    fused = torch.randn(batch.q.shape[0] + 2, 6, 64, dtype=torch.bfloat16)  # q, then padding rows
    q = fused[:, :4]  # a token-strided view, like a slice of the QKV projection
    q[: batch.q.shape[0]] = batch.q
    native = ops.extend_attention(q, *batch.extend_args(0.125)[1:], 0, 0.0, invariant)
    expected = reference.extend_attention_reference(*batch.extend_args(0.125))
    torch.testing.assert_close(
        native[: batch.q.shape[0]].float(), expected.float(), atol=2e-2, rtol=2e-2
    )
    assert torch.equal(native[batch.q.shape[0] :], torch.zeros_like(native[batch.q.shape[0] :]))


def test_extend_op_serves_what_the_amx_kernel_declines() -> None:
    """Sliding windows, soft caps, fp32 and head sizes not a multiple of 64 take the other routes
    (decode rows on an AVX512 build, the portable op elsewhere)."""
    cases = [
        (torch.bfloat16, 64, 0, 0.0),
        (torch.bfloat16, 64, 8, 0.0),
        (torch.bfloat16, 64, 0, 5.0),
        (torch.float32, 64, 0, 0.0),
        (torch.bfloat16, 96, 0, 0.0),
    ]
    for dtype, head_dim, sliding_window, soft_cap in cases:
        batch = make_batch([20, 9], [20, 4], 4, 2, head_dim, 1, dtype)
        out = ops.extend_attention(*batch.extend_args(0.125), sliding_window, soft_cap)
        expected = reference.extend_attention_reference(
            *batch.extend_args(0.125), sliding_window, soft_cap
        )
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_store_kv_rejects_out_of_range_slots_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(6, 2, 4), torch.zeros(6, 2, 4)
    k, v = torch.ones(2, 2, 4), torch.ones(2, 2, 4)
    with pytest.raises(IndexError, match="out of range"):
        ops.store_kv(k_cache, v_cache, k, v, torch.tensor([1, 6]))
    assert not k_cache.any() and not v_cache.any()


def test_portable_ops_agree_with_the_native_ones() -> None:
    batch = make_batch([5, 40, 0], [1, 1, 1], 4, 2, 64, 4, seed=3)
    with_native = ops.decode_attention(*batch.decode_args(0.125))  # the C++ kernel
    # what serves without it
    portable = torch.ops.kernels.decode_attention_portable(*batch.decode_args(0.125))
    torch.testing.assert_close(portable, with_native, atol=2e-5, rtol=2e-5)


def test_cpp_kernels_hand_what_they_decline_to_the_torch_ops() -> None:
    """Strided caches (decode, store) and a soft cap (extend) go from the C++ kernels to
    kernels::*_portable."""
    batch = make_batch([5, 40], [1, 1], 4, 2, 64, 4, torch.bfloat16, seed=4)
    wide_k, wide_v = (
        torch.cat([c, torch.zeros_like(c)], dim=-1) for c in (batch.k_cache, batch.v_cache)
    )
    k_view, v_view = wide_k[..., :64], wide_v[..., :64]  # the same caches, not contiguous
    args = batch.decode_args(0.125)
    out = ops.decode_attention(args[0], k_view, v_view, *args[3:])
    torch.testing.assert_close(
        out.float(), reference.decode_attention_reference(*args).float(), atol=2e-2, rtol=2e-2
    )
    k = torch.randn(2, 2, 64).bfloat16()
    ops.store_kv(k_view, v_view, k, -k, torch.tensor([1, 2]))
    assert torch.equal(wide_k[1:3, :, :64], k) and torch.equal(wide_v[1:3, :, :64], -k)
    extend = make_batch([30], [30], 4, 2, 64, 1, torch.bfloat16, seed=5)
    capped = ops.extend_attention(*extend.extend_args(0.125), 0, 3.0)
    expected = reference.extend_attention_reference(*extend.extend_args(0.125), 0, 3.0)
    torch.testing.assert_close(capped.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_failed_build_gives_no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """`build.load` is what `ops.load_cpu_kernels` runs once; a compiler that fails gives False (the
    portable ops keep serving), and the cached library stays loaded."""
    monkeypatch.setenv("CXX", "/bin/false")
    build.load.cache_clear()
    try:
        assert build.load() is False
    finally:
        monkeypatch.undo()
        build.load.cache_clear()
    assert ops.load_cpu_kernels()


def test_store_kv_from_token_strided_views() -> None:
    """K and V sliced out of a fused QKV output are written without a copy, to the right slots."""
    qkv = torch.randn(3, 4 + 2 + 2, 16)  # per token: 4 q heads, 2 k heads, 2 v heads
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    ops.store_kv(k_cache, v_cache, k, v, torch.tensor([5, -1, 2]))
    assert (
        torch.equal(k_cache[5], k[0])
        and torch.equal(k_cache[2], k[2])
        and torch.equal(v_cache[2], v[2])
    )
    assert k_cache[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_whole_row_and_per_head_tasks_agree(dtype: torch.dtype) -> None:
    """Rows >= 2x the threads run one task per row (all KV heads), fewer rows one task per (row, KV
    head)."""
    batch = make_batch([3, 50, 0, 7, 129, 64], [1] * 6, 8, 4, 64, 1, dtype, seed=7)
    args = batch.decode_args(0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 6 rows >= 2 threads' worth: whole rows
        whole_rows = ops.decode_attention(*args)
        torch.set_num_threads(4)  # 6 rows < 8: per KV head
        per_head = ops.decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(whole_rows, per_head, atol=TOL[dtype], rtol=TOL[dtype])
    expected = reference.decode_attention_reference(*batch.decode_args(0.125))
    torch.testing.assert_close(
        whole_rows.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1000])
def test_argmax_matches_torch_with_ties_nans_and_strides(dtype: torch.dtype, vocab: int) -> None:
    """The first maximum wins a tie, the first NaN wins over everything (torch's rules), any row
    stride."""
    gen = torch.Generator().manual_seed(vocab)
    # rows 'vocab + 5' apart
    x = torch.randn(9, vocab + 5, generator=gen).to(dtype)[:, 2 : 2 + vocab]
    x[1] = 3.0  # all equal
    x[2, vocab // 2 :] = 4.0  # a tie between two positions at least
    x[3] = float("-inf")
    x[4, vocab - 1] = float("nan")
    x[5, vocab // 3] = float("nan")
    x[5, 0] = float("inf")
    torch.testing.assert_close(ops.argmax(x), x.argmax(dim=-1), rtol=0, atol=0)


def test_argmax_hands_what_it_does_not_cover_to_torch() -> None:
    for x in (torch.randn(2, 3, 4), torch.randn(2, 5, dtype=torch.float64)):  # not 2-D; float64
        assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    with pytest.raises(IndexError):  # an empty row has no argmax: torch's error, not a crash
        ops.argmax(torch.randn(2, 0))
