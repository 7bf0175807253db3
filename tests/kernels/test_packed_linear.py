"""The packed-weight ops (`kernels.packed`, `kernels::linear_packed`, `kernels::dequantize`):
- dequantize equals the `gguf` package's dequantizer bit for bit, in every GGUF format, on random
  blocks (random quants, scales and mins: every bit pattern a file may hold);
- fp32 activations (the exact path) equal fp32 `F.linear` on the dequantized weight;
- bf16 activations through the native kernels (int16 activations per row and block of 32), in the
  file's layout and 16 rows interleaved: within a measured relative bound of the exact product
  (the bf16 output's rounding), and batch-invariant: each row's bits equal the row alone, for
  every M around the kernel's row tiles and with or without `invariant`;
- interleaving keeps every byte (the file's blocks come back, rows and embeddings read the same),
  and happens only where the interleaved kernel reads the weight;
- the kernels' C++ built without AVX512 (the AVX2 path) and without AVX2 (the portable path, what
  ARM runs) give the interleaved kernel's native bits exactly, and the file-layout kernel's
  results within its bound;
- `--quantization`'s I8 / I4 round trip within half a step of their scales;
- packed sources narrow by rows and by whole blocks only."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from compiled_engine.layers.weight_utils import PackedSource
from kernels import ops
from kernels.interleave import deinterleave, interleave, rows_of
from kernels.packed import FORMATS, PackedWeight, quantize
from tests.helpers.packed_weights import packed, random_blocks

GGUF_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
INTERLEAVED = GGUF_FORMATS + ["I8", "I4"]  # every format has a 16-row interleaved layout
# max |bf16 kernel - exact| / max |exact| over these shapes, measured 0.002-0.003: the bf16 output's
# rounding (int16 activations add little)
NATIVE_TOLERANCE = 0.006


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


@pytest.mark.parametrize("name", GGUF_FORMATS + ["I8", "I4"] + [f"{n}x16" for n in INTERLEAVED])
def test_bf16_native_kernel_is_close_and_batch_invariant(name: str) -> None:
    k = 768  # three K-quant super-blocks
    w = packed(name, 80 if name.endswith("x16") else 70, k)
    x = torch.randn(11, k).bfloat16()
    bias = torch.randn(w.out_features).bfloat16()
    exact = F.linear(x.float(), w.dequantize(), bias.float())
    got = ops.linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (11, w.out_features)
    err = ((got.float() - exact).abs().max() / exact.abs().max()).item()
    print(f"{name}: bf16 kernel relative error {err:.4f}")
    assert err < NATIVE_TOLERANCE
    alone = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(11)])
    assert torch.equal(got, alone)
    for m in (1, 3, 4, 5, 8, 9):  # full row tiles of 4 and every remainder
        assert torch.equal(ops.linear(x[:m], w, bias, True), got[:m])


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaving_keeps_every_byte(name: str) -> None:
    w = packed(name, 48, 512)
    fmt = FORMATS[f"{name}x16"]
    groups = interleave(w.blocks, w.format)
    assert groups.shape == (3, 16 * w.format.row_bytes(512))
    assert torch.equal(deinterleave(groups, fmt), w.blocks)
    ids = torch.tensor([[0, 17, 47], [31, 16, 15]])
    assert torch.equal(rows_of(groups, fmt, ids), w.blocks[ids])
    held = PackedWeight(groups, fmt, 512)
    assert held.shape == w.shape
    assert torch.equal(held.dequantize(), w.dequantize())
    assert torch.equal(ops.embedding(ids, held), ops.embedding(ids, w))
    x = torch.randn(5, 512)  # fp32 activations: the portable path on the file's blocks, exact
    assert torch.equal(ops.linear(x, held), ops.linear(x, w))


def test_weights_are_interleaved_only_where_the_interleaved_kernel_reads_them() -> None:
    kernels.init("cpu")  # the native CPU kernels, also on a machine whose tests serve CUDA
    def held_as(name: str, rows: int, dtype: torch.dtype) -> str:
        w = packed(name, rows, 256)
        ops.prepare_packed(w, dtype)
        return w.format.name

    assert held_as("Q4_1", 48, torch.bfloat16) == "Q4_1x16"  # the CPU's native kernels loaded
    assert held_as("I8", 48, torch.bfloat16) == "I8x16"
    assert held_as("Q4_1", 48, torch.float32) == "Q4_1"  # fp32: dequantized, exact
    assert held_as("Q6_K", 48, torch.bfloat16) == "Q6_Kx16"
    assert held_as("Q4_1", 40, torch.bfloat16) == "Q4_1"  # rows not a multiple of 16


def test_a_zero_block_and_a_zero_row_give_zeros() -> None:
    """Padding rows of a vocab-parallel LM head are zero bytes: zeros in every format."""
    for name in GGUF_FORMATS + [f"{n}x16" for n in INTERLEAVED]:
        rows = 1 if name.endswith("x16") else 3
        w = PackedWeight(torch.zeros(rows, FORMATS[name].rows * FORMATS[name].row_bytes(256),
                                     dtype=torch.uint8), FORMATS[name], 256)
        x = torch.randn(2, 256).bfloat16()
        x[1] = 0
        assert torch.equal(ops.linear(x, w), torch.zeros(2, w.out_features,
                                                         dtype=torch.bfloat16)), name


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


CPP_BUILDS = {
    # without AVX512: the AVX2 path (older x86, and this CPU capped at COMPILED_ENGINE_CPU_ISA=avx2;
    # with AVX-VNNI where the CPU has it: Intel Alder Lake, AMD Zen 5)
    "avx2": ["-march=native", "-mno-avx512f"],
    # AVX2 without any VNNI: AMD Zen 2 / 3, Intel Haswell to Skylake
    "avx2-no-vnni": ["-march=native", "-mno-avx512f", "-mno-avxvnni"],
    # without AVX2, FMA or F16C: the C++ path that ARM and the oldest x86 run
    "portable": ["-march=x86-64", "-mno-avx2", "-mno-fma", "-mno-f16c"],
}


@pytest.fixture(scope="module", params=list(CPP_BUILDS))
def cpp_kernel(request, tmp_path_factory):
    """The packed kernels' C++ (packed_linear.cpp, packed_linear_x16.cpp) built for a lesser
    ISA, called through ctypes (their C entry point): run(w, x) -> out in x's dtype."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from kernels.cpu import build, isa

    compiler = shutil.which("g++")
    if compiler is None or not isa.is_x86():
        pytest.skip("needs g++ on x86 to build the C++ with the vector ISA off (elsewhere the "
                    "native build is the portable path, tested above)")
    if request.param.startswith("avx2") and "avx2" not in isa.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    lib = tmp_path_factory.mktemp(request.param) / "packed.so"
    sources = [str(Path(build.NATIVE) / f) for f in ("packed_linear.cpp", "packed_linear_x16.cpp")]
    subprocess.run([compiler, "-O2", "-std=c++17", "-fopenmp", "-shared", "-fPIC",
                    *CPP_BUILDS[request.param], *sources, "-o", str(lib)], check=True)
    fn = ctypes.CDLL(str(lib)).ce_packed_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]

    def run(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
        rc = fn(w.code, {torch.float32: 0, torch.bfloat16: 1}[x.dtype], x.data_ptr(),
                w.blocks.data_ptr(), None, out.data_ptr(), x.shape[0], w.out_features,
                w.in_features)
        assert rc == 0
        return out

    return run


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_the_cpp_paths_are_close_and_batch_invariant(cpp_kernel, name: str) -> None:
    w = PackedWeight(random_blocks(name, 24, 512), FORMATS[name], 512)
    x = torch.randn(6, 512)
    exact = F.linear(x, w.dequantize())
    got = cpp_kernel(w, x)
    # int16 activations, fp32 output: about 1e-4 of the largest output
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-3
    assert torch.equal(torch.cat([cpp_kernel(w, x[i : i + 1]) for i in range(6)]), got)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_the_cpp_paths_give_the_interleaved_kernels_native_bits(cpp_kernel, name: str) -> None:
    """Each lane runs the same float operations in the AVX512, AVX2 and scalar code (this
    machine's own build serves `ops.linear`), for every row tile."""
    kernels.init("cpu")
    w = packed(f"{name}x16", 48, 512)
    x = torch.randn(9, 512).bfloat16()
    assert torch.equal(cpp_kernel(w, x), ops.linear(x, w))
