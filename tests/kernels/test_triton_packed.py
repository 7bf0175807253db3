"""The packed linear's Triton kernel (CUDA's, `kernels/triton/packed.py`) on CPU tensors under
TRITON_INTERPRET=1, at small shapes: each format of blocks of 32 against fp32 `F.linear` on the
dequantized weight (the portable path), with a bias and for bf16 activations, and batch-invariant
(each row's result the same alone or in a batch, across row tiles)."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.packed_weights import packed

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="TRITON_INTERPRET is not 1: the cuda tests run the kernel"),
]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "I8", "I4"])
def test_the_triton_packed_linear_equals_the_dequantized_product(name: str) -> None:
    from kernels.triton.packed import packed_linear_triton

    w = packed(name, 40, 64)  # N across three tiles of 16, the last one partial
    x = torch.randn(18, 64)  # rows across two tiles
    bias = torch.randn(40)
    exact = F.linear(x, w.dequantize(), bias)
    got = packed_linear_triton(x, w.blocks, w.format, 64, bias)
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
    assert torch.equal(packed_linear_triton(x[17:], w.blocks, w.format, 64, bias), got[17:])
    xb = x.bfloat16()
    got_bf16 = packed_linear_triton(xb, w.blocks, w.format, 64)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), F.linear(xb.float(), w.dequantize()),
                               atol=2e-2, rtol=1e-2)
