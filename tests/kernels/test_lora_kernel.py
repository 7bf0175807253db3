"""LoRA's delta: the Triton kernels (CUDA's, `kernels/triton/lora.py`) on CPU tensors under
TRITON_INTERPRET=1, and the portable path, against each token's product in fp32, at small shapes
that cross the kernels' tile edges (K, N and R), with tokens without an adapter (slot -1), B whole
or block-diagonal by projection (q / k / v), contiguous or strided as the linears store it; and
batch-invariant (a token's result the same bits alone or in a batch). The CPU's paths (the native
grouped kernel, and the portable code eager and compiled) the same way."""

import importlib.util
import os

import pytest
import torch

from kernels import ops
from kernels.portable.lora import lora_delta

interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton is not installed, or TRITON_INTERPRET is not 1 (the kernels compile for CUDA)",
)


def _adapters(tokens: int, k: int, r: int, part_rows: tuple[int, ...], slots: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K], a [S+1, R, K], b [S+1, N, R] (N: part_rows[-1]; zero off each projection's block
    of R / P columns; the last slot zero, as the engine keeps them) and each token's slot, -1 and
    the zero slot's own index among them."""
    gen = torch.Generator().manual_seed(r + k)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = torch.randn(slots + 1, r, k, generator=gen) / k**0.5
    b = torch.zeros(slots + 1, part_rows[-1], r)
    width = r // (len(part_rows) - 1)
    for p, (lo, hi) in enumerate(zip(part_rows, part_rows[1:])):
        b[:, lo:hi, p * width:(p + 1) * width] = torch.randn(slots + 1, hi - lo, width,
                                                             generator=gen) / width**0.5
    a[-1], b[-1] = 0, 0
    ids = torch.randint(-1, slots, (tokens,), generator=gen)
    ids[:3] = torch.tensor([-1, slots - 1, slots])  # none, the last adapter, the zero slot by index
    return x, a.to(dtype), b.to(dtype), ids


def _no_adapter(slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The tokens on the zero slot (-1 or its index)."""
    return (slots == -1) | (slots == a.shape[0] - 1)


def _as_stored(b: torch.Tensor) -> torch.Tensor:
    """B [S, N, R] as the linears pass it: a view of their [S, R, N] buffer."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


def _reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """Token by token in fp32: b[s] @ (a[s] @ x[t])."""
    return torch.stack([b[s].float() @ (a[s].float() @ x[t].float())
                        for t, s in enumerate(slots.tolist())])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "part_rows"), [(16, (0, 36)), (48, (0, 36)),
                                              (48, (0, 20, 28, 36))])
def test_the_triton_delta_is_each_tokens_product(dtype: torch.dtype, r: int,
                                                 part_rows: tuple[int, ...]) -> None:
    from kernels.triton.lora import lora_delta_triton

    # the interpreter's tiles are 16 wide: K in two splits of 32 (the last partial), N and R across
    # tiles
    x, a, b, slots = _adapters(19, 40, r, part_rows, 3, dtype)
    if len(part_rows) > 2:
        b = _as_stored(b)
    got = lora_delta_triton(x, a, b, slots, part_rows)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), _reference(x, a, b, slots), atol=tol, rtol=tol)
    assert torch.equal(got[_no_adapter(slots, a)], torch.zeros_like(got[_no_adapter(slots, a)]))
    for lo, hi in ((0, 1), (5, 6), (3, 19), (17, 19)):
        alone = lora_delta_triton(x[lo:hi], a, b, slots[lo:hi], part_rows)
        assert torch.equal(alone, got[lo:hi]), (lo, hi)


def test_the_portable_delta_is_each_tokens_product() -> None:
    x, a, b, slots = _adapters(7, 40, 48, (0, 20, 28, 36), 3, torch.float32)
    got = lora_delta(x, a, b, slots, (0, 20, 28, 36))
    torch.testing.assert_close(got, _reference(x, a, b, slots), atol=1e-5, rtol=1e-5)


def _native_delta(x, a, b, slots, part_rows):
    assert ops.load_cpu_kernels(), "the native CPU kernels did not build"
    return torch.ops.kernels.lora_delta.default(x, a, b, slots, part_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "part_rows"), [(16, (0, 36)), (48, (0, 20, 28, 36)), (6, (0, 70)),
                                              (9, (0, 20, 28, 136))])
@pytest.mark.parametrize("path", ["native", "portable"])
def test_the_cpu_delta_is_each_tokens_product_alone_or_batched(dtype: torch.dtype, r: int,
                                                               part_rows: tuple[int, ...],
                                                               path: str) -> None:
    """What a CPU step runs (`ops.lora_delta`: the native grouped kernel where it builds, else the
    portable code, eager and compiled as a graph holds it): each token's product, zeros without an
    adapter, the same bits alone as in a batch. The shapes cross the native kernel's tiles: 4 rows
    (19 tokens, 3 adapters), 4 rows of A (ranks 6 and 3), 16 lanes of K (40) and 64 columns of B
    (70, 136)."""
    x, a, b, slots = _adapters(19, 40, r, part_rows, 3, dtype)
    b = _as_stored(b)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    paths = {"native": (_native_delta, torch.compile(ops.lora_delta, dynamic=True)),
             "portable": (lora_delta, torch.compile(lora_delta, dynamic=True))}
    if path == "native":  # rows without an adapter are not even read: their input does not matter
        poisoned = x.clone()
        poisoned[_no_adapter(slots, a)] = float("nan")
        assert torch.equal(_native_delta(poisoned, a, b, slots, part_rows),
                           _native_delta(x, a, b, slots, part_rows))
    for delta in paths[path]:
        got = delta(x, a, b, slots, part_rows)
        torch.testing.assert_close(got.float(), _reference(x, a, b, slots), atol=tol, rtol=tol)
        assert torch.equal(got[_no_adapter(slots, a)], torch.zeros_like(got[_no_adapter(slots, a)]))
        for lo, hi in ((0, 2), (5, 7), (3, 19), (17, 19)):
            alone = delta(x[lo:hi], a, b, slots[lo:hi], part_rows)
            assert torch.equal(alone, got[lo:hi]), (lo, hi)
