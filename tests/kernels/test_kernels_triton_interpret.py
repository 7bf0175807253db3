"""The Triton kernels on CPU tensors under TRITON_INTERPRET=1, at small shapes, against the
reference."""

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

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def triton_attention():
    from kernels.triton import attention as triton_attention

    return triton_attention


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode(triton_attention, page_size: int, group: int) -> None:
    seq_lens = [1, 16, 17, 40, 0, 5]
    batch = make_batch(
        seq_lens, [1] * len(seq_lens), 2 * group, 2, 16, page_size, seed=group, extra_width=5
    )
    args = batch.decode_args(0.3)
    _close(
        triton_attention.decode_attention_triton(*args), reference.decode_attention_reference(*args)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_dtypes_with_splits(triton_attention, dtype: torch.dtype) -> None:
    """Split-K: three splits per row, some empty (short rows), merged by log-sum-exp."""
    seq_lens = [70, 1, 0, 130, 64]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 4, 2, 24, 16, dtype, seed=3)
    args = batch.decode_args(0.2)
    actual = triton_attention.decode_attention_triton(*args, num_splits=3)
    assert actual.dtype == dtype
    _close(actual, reference.decode_attention_reference(*args))


@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(5, 0.0), (0, 4.0), (20, 2.0)])
def test_decode_window_and_soft_cap(triton_attention, sliding_window: int, soft_cap: float) -> None:
    seq_lens = [3, 5, 6, 50, 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 4, 2, 16, 16, seed=sliding_window)
    args = (*batch.decode_args(0.5), sliding_window, soft_cap)
    expected = reference.decode_attention_reference(*args)
    _close(triton_attention.decode_attention_triton(*args, num_splits=2), expected)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_extend(triton_attention, page_size: int, group: int) -> None:
    """Prefix 0 and > 0, q_len 1, page boundaries, an idle row, and token padding past
    cu_q_lens[-1]."""
    q_lens = [17, 1, 3, 0, 16]
    prefixes = [0, 16, 30, 4, 1]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    batch = make_batch(
        seq_lens, [*q_lens[:-1], q_lens[-1] + 2], 2 * group, 2, 16, page_size, seed=group
    )
    batch.cu_q_lens[-1] -= 2
    args = batch.extend_args(0.3)
    actual = triton_attention.extend_attention_triton(*args)
    _close(actual, reference.extend_attention_reference(*args))
    assert torch.equal(actual[-2:], torch.zeros_like(actual[-2:]))


@pytest.mark.parametrize(
    ("dtype", "sliding_window", "soft_cap"), [(torch.bfloat16, 0, 0.0), (torch.float32, 6, 3.0)]
)
def test_extend_dtype_window_soft_cap(
    triton_attention, dtype: torch.dtype, sliding_window: int, soft_cap: float
) -> None:
    q_lens = [20, 2]
    seq_lens = [25, 33]
    batch = make_batch(seq_lens, q_lens, 4, 2, 32, 16, dtype, seed=7)
    args = (*batch.extend_args(0.2), sliding_window, soft_cap)
    _close(
        triton_attention.extend_attention_triton(*args), reference.extend_attention_reference(*args)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(triton_attention, dtype: torch.dtype) -> None:
    k_cache, v_cache = torch.zeros(12, 2, 8, dtype=dtype), torch.zeros(12, 2, 8, dtype=dtype)
    k, v = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    slots = torch.tensor([3, -1, 11, 0, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_reference(expected_k, expected_v, k, v, slots)
    triton_attention.store_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
