"""The CPU path of the kernels custom ops against the per-head fp32 reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ops, reference
from kernels.portable import attention as cpu_attention
from tests.helpers.kernel_batches import make_batch

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# The op (the native kernels where they load: on an AVX512 CPU without AMX an extend runs as decode
# rows) and its portable implementation (CPUs without the native library, inputs the kernels
# decline).
EXTENDS = {
    "op": ops.extend_attention,
    "portable": torch.ops.kernels.extend_attention_portable.default,
}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _lengths(n: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, high + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_realistic(dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    seq_lens = [*_lengths(14, 1024, seed=head_dim + page_size), 1, 16, 17, 1024, 0, 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 8, 2, head_dim, page_size, dtype)
    args = batch.decode_args(head_dim**-0.5)
    _close(ops.decode_attention(*args), reference.decode_attention_reference(*args))


@pytest.mark.parametrize("impl", EXTENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_realistic(impl: str, dtype: torch.dtype, page_size: int) -> None:
    q_lens = [64, 1, 17, 40, 16, 0, 5, 33]
    prefixes = [0, 900, 0, 300, 16, 0, 1, 128]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    batch = make_batch(seq_lens, q_lens, 8, 2, 128, page_size, dtype, seed=page_size)
    args = batch.extend_args(128**-0.5)
    _close(EXTENDS[impl](*args, 0, 0.0, False), reference.extend_attention_reference(*args))


@pytest.mark.parametrize("impl", EXTENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("soft_cap", [0.0, 3.0])
def test_extend_of_many_similar_suffixes_runs_padded(
    impl: str, dtype: torch.dtype, soft_cap: float
) -> None:
    """Short suffixes over cached prefixes (a shared system prompt) attend in padded groups: same
    result."""
    q_lens = [8, 8, 7, 8, 16, 15, 16, 1, 64, 64]
    prefixes = [100, 100, 101, 90, 100, 99, 100, 120, 0, 0]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    reqs = [
        cpu_attention._Req(b, 0, q, n)
        for b, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True))
    ]
    # The 1-token query and the two prompts without a prefix (SDPA's causal path) attend alone.
    assert sorted(len(g) for g in cpu_attention._attention_groups(reqs, 0)) == [1, 1, 1, 3, 4]
    assert all(len(g) == 1 for g in cpu_attention._attention_groups(reqs, 8))
    batch = make_batch(seq_lens, q_lens, 6, 2, 64, 16, dtype, seed=7)
    args = (*batch.extend_args(64**-0.5), 0, soft_cap)
    _close(EXTENDS[impl](*args, False), reference.extend_attention_reference(*args))


@pytest.mark.parametrize("impl", EXTENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(8, 0.0), (0, 5.0), (20, 2.0), (1, 0.0)])
def test_window_and_soft_cap(
    impl: str, dtype: torch.dtype, sliding_window: int, soft_cap: float
) -> None:
    seq_lens = [1, 7, 8, 9, 33, 70, 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 4, 2, 32, 16, dtype, seed=sliding_window)
    args = (*batch.decode_args(0.3), sliding_window, soft_cap)
    _close(ops.decode_attention(*args), reference.decode_attention_reference(*args))
    q_lens = [1, 7, 3, 9, 20, 35, 0]
    batch = make_batch(seq_lens, q_lens, 4, 2, 32, 16, dtype, seed=sliding_window)
    args = (*batch.extend_args(0.3), sliding_window, soft_cap)
    _close(EXTENDS[impl](*args, False), reference.extend_attention_reference(*args))


def test_decode_padding_rows_are_zero() -> None:
    batch = make_batch([0, 0], [1, 1], 4, 2, 16, 1)
    assert torch.equal(ops.decode_attention(*batch.decode_args(1.0)), torch.zeros_like(batch.q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_negative_slots(dtype: torch.dtype) -> None:
    k_cache, v_cache = torch.zeros(10, 2, 8, dtype=dtype), torch.zeros(10, 2, 8, dtype=dtype)
    k, v = torch.randn(4, 2, 8).to(dtype), torch.randn(4, 2, 8).to(dtype)
    slots = torch.tensor([3, -1, 7, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_reference(expected_k, expected_v, k, v, slots)
    ops.store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    ops.store_kv(k_cache, v_cache, k[:2], v[:2], torch.tensor([0, 1]))
    assert torch.equal(k_cache[:2], k[:2]) and torch.equal(v_cache[:2], v[:2])


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_ragged_batches(
    rows: list[tuple[int, int]], page_size: int, group: int, seed: int
) -> None:
    """Random lengths, random page placement; a row with q_len 0 is an idle row in the extend
    batch."""
    q_lens = [q for q, _ in rows]
    seq_lens = [q + p for q, p in rows]
    batch = make_batch(seq_lens, q_lens, 2 * group, 2, 16, page_size, seed=seed, extra_width=3)
    args = batch.extend_args(0.25)
    _close(ops.extend_attention(*args), reference.extend_attention_reference(*args))
    decode = make_batch(
        seq_lens, [1] * len(rows), 2 * group, 2, 16, page_size, seed=seed, extra_width=3
    )
    args = decode.decode_args(0.25)
    _close(ops.decode_attention(*args), reference.decode_attention_reference(*args))


def test_opcheck() -> None:
    batch = make_batch([5, 17, 0], [1, 1, 1], 4, 2, 16, 4)
    torch.library.opcheck(
        torch.ops.kernels.decode_attention.default, (*batch.decode_args(0.25), 0, 0.0)
    )
    batch = make_batch([5, 17, 3], [2, 17, 1], 4, 2, 16, 4)
    torch.library.opcheck(
        torch.ops.kernels.extend_attention.default, (*batch.extend_args(0.25), 4, 0.0)
    )
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([2, -1, 9])
    torch.library.opcheck(
        torch.ops.kernels.store_kv.default, (batch.k_cache, batch.v_cache, k, v, slots)
    )


def test_ops_inside_torch_compile() -> None:
    """Store then attend in one fullgraph compiled function with a dynamic token count."""

    def step(q, k, v, k_cache, v_cache, slots, page_table, cu_q_lens, seq_lens, decode_q):
        ops.store_kv(k_cache, v_cache, k, v, slots)
        extend = ops.extend_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, 0.25, 4)
        decode = ops.decode_attention(decode_q, k_cache, v_cache, page_table, seq_lens, 0.25, 4)
        return extend * 2, decode + 1

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for i, q_lens in enumerate(([3, 5], [7, 4])):
        batch = make_batch([10, 9], q_lens, 4, 2, 16, 4, seed=sum(q_lens) + q_lens[0])
        tokens = sum(q_lens)
        k, v = torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
        slots = torch.cat(
            [
                batch.page_table[b, n - q : n]
                for b, (n, q) in enumerate(zip([10, 9], q_lens, strict=True))
            ]
        )
        decode_q = torch.randn(2, 4, 16)
        args = (
            batch.q,
            k,
            v,
            batch.k_cache,
            batch.v_cache,
            slots.long(),
            batch.page_table,
            batch.cu_q_lens,
            batch.seq_lens,
            decode_q,
        )
        eager_caches = (batch.k_cache.clone(), batch.v_cache.clone())
        expected = step(*args[:3], *eager_caches, *args[5:])
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            actual = compiled(*args)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close((batch.k_cache, batch.v_cache), eager_caches)
