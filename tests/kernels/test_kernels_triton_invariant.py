"""Deterministic mode's Triton kernels (the CUDA path), on CPU tensors under TRITON_INTERPRET=1: a
row's result does not depend on its batch, and an extend gives each query the bits of its decode
step."""

import importlib.util
import os

import pytest
import torch

from kernels import reference
from tests.helpers.kernel_batches import make_batch

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason=(
            "TRITON_INTERPRET is not 1: the kernels are compiled for CUDA "
            "and tested by the cuda tests"
        ),
    ),
]


@pytest.fixture(scope="module")
def triton_kernels():
    from kernels.triton import attention, matmul

    return attention, matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(triton_kernels, dtype):
    _, matmul = triton_kernels
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 50, generator=gen) * 0.1).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(37, 50, generator=gen).to(dtype)
    full = matmul.invariant_linear_triton(x, w, b)
    # Any number of rows, and rows moved by whole tiles (16 here). The interpreter's tile product
    # (numpy) may round a row differently at another position inside a tile; a GPU's MMA does not,
    # which this cannot show.
    for lo, hi in ((0, 1), (0, 5), (0, 20), (16, 32), (16, 37)):
        assert torch.equal(matmul.invariant_linear_triton(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    expected = (x.double() @ w.double().T + b.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 6])
def test_extend_is_decode_query_by_query(triton_kernels, window):
    attention, _ = triton_kernels
    batch = make_batch(
        [20, 7, 33],
        [20, 3, 9],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seed=2,
        extra_width=3,
    )
    q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:])])  # two padding tokens
    out = attention.extend_attention_invariant_triton(q, *batch.extend_args(0.25)[1:], window)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    expected = reference.extend_attention_reference(*batch.extend_args(0.25), window)
    torch.testing.assert_close(out[:-2], expected, atol=2e-5, rtol=2e-5)
    cu, lens = batch.cu_q_lens.tolist(), batch.seq_lens.tolist()
    for b in range(len(lens)):
        for j in range(cu[b], cu[b + 1]):
            position = lens[b] - (cu[b + 1] - j)
            one = attention.decode_attention_triton(
                batch.q[j : j + 1],
                batch.k_cache,
                batch.v_cache,
                batch.page_table[b : b + 1],
                torch.tensor([position + 1], dtype=torch.int32),
                0.25,
                window,
                num_splits=1,
            )
            assert torch.equal(one[0], out[j]), (b, j)
    # Request 2 alone (q rows 23-31, positions 24-32), its 9 queries in two chunks (4 + 5): the same
    # bits.
    for lo, hi in ((23, 27), (27, 32)):
        alone = attention.extend_attention_invariant_triton(
            batch.q[lo:hi],
            batch.k_cache,
            batch.v_cache,
            batch.page_table[2:],
            torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([33 - (32 - hi)], dtype=torch.int32),
            0.25,
            window,
        )
        assert torch.equal(alone, out[lo:hi])
