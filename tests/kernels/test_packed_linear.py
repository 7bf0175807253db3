"""The packed-weight ops (`kernels.packed`, `kernels::linear_packed`, `kernels::dequantize`):
- dequantize equals the `gguf` package's dequantizer bit for bit, in every GGUF format, on random
  blocks (random quants, scales and mins: every bit pattern a file may hold);
- fp32 activations (the exact path) equal fp32 `F.linear` on the dequantized weight;
- bf16 activations through the native kernel (int16 activations per row and block of 32): within
  a measured relative bound of the exact product (the bf16 output's rounding), and
  batch-invariant: each row's bits equal the row alone, for every M around the kernel's row tiles
  and with or without `invariant`;
- `--quantization`'s I8 / I4 round trip within half a step of their scales;
- packed sources narrow by rows and by whole blocks only."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compiled_engine.layers.weight_utils import PackedSource
from kernels import ops
from kernels.packed import FORMATS, PackedWeight, quantize

GGUF_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# max |bf16 kernel - exact| / max |exact| over these shapes, measured 0.002-0.003: the bf16 output's
# rounding (int16 activations add little)
NATIVE_TOLERANCE = 0.006


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in `name`'s layout with finite, small fp16 scales: [n, row bytes]."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scale = rng.uniform(-0.01, 0.01, size=(n, k // fmt.block, 1)).astype(np.float16)
        b[..., at : at + 2] = scale.view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_dequantize_equals_the_gguf_package(name: str) -> None:
    blocks = random_blocks(name, 5, 512)
    expected = gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, name))
    got = PackedWeight(blocks, FORMATS[name], 512).dequantize()
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_fp32_activations_are_exact(name: str) -> None:
    w = PackedWeight(random_blocks(name, 40, 512), FORMATS[name], 512)
    x, bias = torch.randn(7, 512), torch.randn(40)
    torch.testing.assert_close(ops.linear(x, w, bias), F.linear(x, w.dequantize(), bias))


@pytest.mark.parametrize("name", GGUF_FORMATS + ["I8", "I4"])
def test_bf16_native_kernel_is_close_and_batch_invariant(name: str) -> None:
    k = 768  # three K-quant super-blocks
    if name in ("I8", "I4"):
        w = quantize(torch.randn(70, k) * 0.05, FORMATS[name])
    else:
        w = PackedWeight(random_blocks(name, 70, k), FORMATS[name], k)
    x = torch.randn(11, k).bfloat16()
    bias = torch.randn(70).bfloat16()
    exact = F.linear(x.float(), w.dequantize(), bias.float())
    got = ops.linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    err = ((got.float() - exact).abs().max() / exact.abs().max()).item()
    print(f"{name}: bf16 kernel relative error {err:.4f}")
    assert err < NATIVE_TOLERANCE
    alone = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(11)])
    assert torch.equal(got, alone)
    for m in (1, 3, 4, 5, 8, 9):  # full row tiles of 4 and every remainder
        assert torch.equal(ops.linear(x[:m], w, bias, True), got[:m])


def test_a_zero_block_and_a_zero_row_give_zeros() -> None:
    """Padding rows of a vocab-parallel LM head are zero bytes: zeros in every format."""
    for name in GGUF_FORMATS:
        w = PackedWeight(torch.zeros(3, FORMATS[name].row_bytes(256), dtype=torch.uint8),
                         FORMATS[name], 256)
        x = torch.randn(2, 256).bfloat16()
        x[1] = 0
        assert torch.equal(ops.linear(x, w), torch.zeros(2, 3, dtype=torch.bfloat16)), name


@pytest.mark.parametrize(("name", "qmax"), [("I8", 127), ("I4", 7)])
def test_weight_only_quantization_round_trip(name: str, qmax: int) -> None:
    w = torch.randn(16, 96) * 0.1
    w[3] = 0  # a zero group: scale 0, quants 0
    packed = quantize(w, FORMATS[name])
    assert packed.nbytes == 16 * 3 * FORMATS[name].nbytes
    back = packed.dequantize()
    step = w.reshape(16, 3, 32).abs().amax(-1, keepdim=True) / qmax
    error = (back - w).reshape(16, 3, 32).abs()
    # half a step, plus the bf16 rounding of the scale over qmax steps
    assert (error <= step * (0.5 + qmax / 128) + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(96))


def test_packed_sources_narrow_by_rows_and_whole_blocks() -> None:
    fmt = FORMATS["Q4_1"]
    blocks = random_blocks("Q4_1", 6, 128)
    src = PackedSource(blocks, fmt, (6, 128))
    rows = src[2:5, :]
    assert rows.shape == (3, 128) and torch.equal(rows.blocks, blocks[2:5])
    cols = src[:, 64:128]
    assert cols.shape == (6, 64)
    torch.testing.assert_close(cols.dequantize(), src.dequantize()[:, 64:])
    assert src.splits_at(1, 64) and not src.splits_at(1, 48)
    with pytest.raises(ValueError, match="do not fall on its blocks of 32"):
        src[:, 16:80]


def test_a_packed_weight_refuses_rows_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="not a multiple of its block 256"):
        PackedWeight(torch.zeros(2, 144, dtype=torch.uint8), FORMATS["Q4_K"], 300)
    with pytest.raises(ValueError, match="do not hold rows of 512"):
        PackedWeight(torch.zeros(2, 144, dtype=torch.uint8), FORMATS["Q4_K"], 512)


@pytest.fixture(scope="module")
def scalar_kernel(tmp_path_factory):
    """packed_linear.cpp built without AVX2, FMA or F16C: the C++ path that ARM and older x86 run,
    called through ctypes (its C entry point, float32 activations)."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from kernels.cpu import build, isa

    compiler = shutil.which("g++")
    if compiler is None or not isa._x86():
        pytest.skip("needs g++ on x86 to build the portable C++ path with the vector ISA off")
    lib = tmp_path_factory.mktemp("scalar") / "packed_scalar.so"
    source = Path(build.NATIVE) / "packed_linear.cpp"
    subprocess.run([compiler, "-O2", "-std=c++17", "-fopenmp", "-shared", "-fPIC", "-march=x86-64",
                    "-mno-avx2", "-mno-fma", "-mno-f16c", str(source), "-o", str(lib)], check=True)
    fn = ctypes.CDLL(str(lib)).ce_packed_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]

    def run(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], w.out_features)
        rc = fn(w.code, 0, x.data_ptr(), w.blocks.data_ptr(), None, out.data_ptr(), x.shape[0],
                w.out_features, w.in_features)
        assert rc == 0
        return out

    return run


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_the_portable_cpp_path_is_close_and_batch_invariant(scalar_kernel, name: str) -> None:
    w = PackedWeight(random_blocks(name, 24, 512), FORMATS[name], 512)
    x = torch.randn(6, 512)
    exact = F.linear(x, w.dequantize())
    got = scalar_kernel(w, x)
    # int16 activations, fp32 output: about 1e-4 of the largest output
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-3
    assert torch.equal(torch.cat([scalar_kernel(w, x[i : i + 1]) for i in range(6)]), got)
