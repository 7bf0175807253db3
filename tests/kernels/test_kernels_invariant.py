"""Deterministic mode's kernels (`invariant=True`): a row's result is bit-identical whatever shares
its batch, however its prompt is chunked, and whether it runs as a decode or an extend step; and
still the right result. Both the native kernels and the portable ones (what serves without the
native library)."""

import pytest
import torch

from kernels import ops, reference
from tests.helpers.kernel_batches import make_batch

NATIVE = ops.load_cpu_kernels()
IMPLS = ["native", "portable"] if NATIVE else ["portable"]


def _linear(impl: str):
    op = torch.ops.kernels.linear if impl == "native" else torch.ops.kernels.linear_portable
    return lambda x, w, b=None: op(x, w, b, True)


def _attention(impl: str):
    suffix = "" if impl == "native" else "_portable"
    decode, extend = (
        getattr(torch.ops.kernels, "decode_attention" + suffix),
        getattr(torch.ops.kernels, "extend_attention" + suffix),
    )
    return (lambda *a, window=0, cap=0.0: decode(*a, window, cap, True),
            lambda *a, window=0, cap=0.0: extend(*a, window, cap, True))


@pytest.mark.parametrize("impl", IMPLS)
# float16: the portable route
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(576, 576), (200, 37), (1536, 96)])
def test_linear_rows_do_not_depend_on_the_batch(impl, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    linear = _linear(impl)
    alone = torch.cat([linear(x[i : i + 1], w, b) for i in range(len(x))])
    for m in (2, 5, 7, 33, 70):
        assert torch.equal(linear(x[:m], w, b), alone[:m]), m
    assert torch.equal(linear(x[3:40], w, b), alone[3:40])
    exact = x.double() @ w.double().T + b.double()
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-9, torch.float32: 1e-5}[dtype]
    assert ((alone.double() - exact).abs() <= tol * (1 + exact.abs())).all()


@pytest.mark.skipif(not NATIVE, reason="needs the native CPU kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_and_portable_linear_agree_to_rounding(dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    x = torch.randn(9, 64, generator=gen).to(dtype)
    torch.testing.assert_close(_linear("native")(x, w), _linear("portable")(x, w))


def _queries_as_decodes(batch, decode, scale: float, **kw) -> torch.Tensor:
    """Every query of the batch as a one-row decode step with the keys up to its own position."""
    rows = []
    cu, lens = batch.cu_q_lens.tolist(), batch.seq_lens.tolist()
    for b in range(len(lens)):
        for j in range(cu[b], cu[b + 1]):
            position = lens[b] - (cu[b + 1] - j)
            rows.append(
                decode(
                    batch.q[j : j + 1],
                    batch.k_cache,
                    batch.v_cache,
                    batch.page_table[b : b + 1],
                    torch.tensor([position + 1], dtype=torch.int32),
                    scale,
                    **kw,
                )
            )
    return torch.cat(rows)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (5, 0.0), (0, 4.0)])
def test_extend_is_decode_query_by_query(impl, dtype, window, cap):
    """A prefill, a cached-prefix extend and a decode step give each query the same bits."""
    decode, extend = _attention(impl)
    batch = make_batch(
        [23, 9, 40, 1],
        [23, 4, 17, 1],
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        dtype=dtype,
        seed=3,
    )
    out = extend(*batch.extend_args(0.125), window=window, cap=cap)
    assert torch.equal(out, _queries_as_decodes(batch, decode, 0.125, window=window, cap=cap))
    expected = reference.extend_attention_reference(*batch.extend_args(0.125), window, cap)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_extend_rows_do_not_depend_on_chunking_or_batch(impl):
    decode, extend = _attention(impl)
    full = make_batch([30, 12], [30, 12], num_heads=4, num_kv_heads=4, head_dim=32, page_size=1,
                      dtype=torch.bfloat16, seed=5)
    whole = extend(*full.extend_args(0.2))
    # Request 0 alone, its prompt in chunks of 7 + 11 + 12 tokens (the earlier ones already in the
    # cache).
    chunks, start = [], 0
    for size in (7, 11, 12):
        seq_len = torch.tensor([start + size], dtype=torch.int32)
        cu = torch.tensor([0, size], dtype=torch.int32)
        chunks.append(
            extend(
                full.q[start : start + size],
                full.k_cache,
                full.v_cache,
                full.page_table[:1],
                cu,
                seq_len,
                0.2,
            )
        )
        start += size
    assert torch.equal(torch.cat(chunks), whole[:30])
    # Request 1 alone.
    alone = extend(full.q[30:], full.k_cache, full.v_cache, full.page_table[1:],
                   torch.tensor([0, 12], dtype=torch.int32), full.seq_lens[1:], 0.2)
    assert torch.equal(alone, whole[30:])


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_rows_do_not_depend_on_the_batch_or_padding(impl):
    decode, _ = _attention(impl)
    batch = make_batch(
        [17, 0, 5, 64, 1],
        [1, 1, 1, 1, 1],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=2,
        dtype=torch.bfloat16,
        seed=7,
    )
    out = decode(*batch.decode_args(0.1))
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
    for b in (0, 2, 3, 4):
        alone = decode(
            batch.q[b : b + 1],
            batch.k_cache,
            batch.v_cache,
            batch.page_table[b : b + 1],
            batch.seq_lens[b : b + 1],
            0.1,
        )
        assert torch.equal(alone, out[b : b + 1]), b


DPBF16 = NATIVE and "avx512bf16" in (ops.native_isa() or set())


@pytest.mark.skipif(
    not DPBF16, reason="needs avx512_bf16 (the CPU flag, COMPILED_ENGINE_CPU_ISA avx512 or native)"
)
def test_deterministic_bf16_linears_take_the_avx512_bf16_kernel_where_the_cpu_has_it():
    """Even K: the dot-product kernel (K = 80: not the AMX route's multiple of 32, on a CPU that has
    AMX too); odd K, or float32 weights: the FMA kernel. Both are held to the invariance tests
    above."""
    assert ops.linear_route(torch.randn(64, 80).bfloat16(), invariant=True) == "invariant_dpbf16"
    assert ops.linear_route(torch.randn(64, 37).bfloat16(), invariant=True) == "invariant"
    assert ops.linear_route(torch.randn(64, 80), invariant=True) == "invariant"
