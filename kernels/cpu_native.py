"""The native CPU kernels of `kernels/native/` (attention.cpp: decode attention and the KV store;
extend_attention.cpp: AMX flash attention for prefill / extend; linear.cpp: the AMX bf16 linear;
sampling.cpp: the greedy argmax; torch_ops.cpp: their registration as the CPU kernels of the kernels::
ops), built into one library against this torch with the system C++ compiler on first use (~15 s,
cached under inductor's cache folder by a hash of the sources, flags, compiler, torch and CPU). Loading
it registers the ops' C++ kernels; the functions here call the same kernels through ctypes (which
releases the GIL) for the Python paths. Everything here returns None when the library is unavailable
(no compiler, `COMPILED_ENGINE_NATIVE=0`) so that callers fall back to the torch implementations.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
SOURCES = [
    NATIVE / name
    for name in ("attention.cpp", "extend_attention.cpp", "linear.cpp", "sampling.cpp", "torch_ops.cpp")
]
HEADERS = [NATIVE / "common.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _torch_flags() -> list[str]:
    """Compiling and linking against this torch (torch_ops.cpp registers the kernels with its dispatcher)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = cpp_extension.library_paths()
    return [
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        *(f"-L{path}" for path in lib_dirs),
        *(f"-Wl,-rpath,{path}" for path in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
    ]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [path.read_text() for path in SOURCES + HEADERS]
    flags = FLAGS + _torch_flags()
    parts = [*texts, *flags, version, torch.__version__, _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    target = Path(cache_dir()) / "compiled_engine_native" / f"cpu_native-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *map(str, SOURCES), *flags, "-o", tmp], capture_output=True, text=True,
                           check=True)
            os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (logged once) when it cannot be built here."""
    if os.environ.get("COMPILED_ENGINE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found: the CPU ops use their torch / oneDNN fallbacks")
        return None
    try:
        path = str(_build(compiler))
        torch.ops.load_library(path)  # registers the CPU kernels of the kernels:: ops (torch_ops.cpp)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building the native CPU kernels failed, using the torch fallbacks: %s", detail[-2000:])
        return None
    lib.ce_decode_attention.argtypes = [ctypes.c_int, *[_ptr] * 4, _i64, _ptr, _ptr, *[_i64] * 5, _f32, _i64, _f32]
    lib.ce_decode_attention.restype = ctypes.c_int
    lib.ce_store_kv.argtypes = [*[_ptr] * 4, _i64, _i64, _ptr, *[_i64] * 4]
    lib.ce_store_kv.restype = _i64
    lib.ce_amx_init.restype = ctypes.c_int
    lib.ce_argmax.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr]
    lib.ce_argmax.restype = ctypes.c_int
    if hasattr(lib, "ce_linear_bf16"):  # built only where the compiler targets AMX
        lib.ce_packed_bf16_size.argtypes = [_i64, _i64]
        lib.ce_packed_bf16_size.restype = _i64
        lib.ce_pack_bf16_weight.argtypes = [_ptr, _ptr, _i64, _i64]
        lib.ce_linear_bf16.argtypes = [*[_ptr] * 4, _i64, _i64, _i64]
        lib.ce_extend_attention_bf16.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
                                                 *[_i64] * 5, _f32]
        lib.ce_extend_attention_bf16.restype = ctypes.c_int
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether the AMX bf16 kernels (linear, extend attention) run here: built for AMX, and Linux granted
    this process the tile state."""
    lib = library()
    return lib is not None and hasattr(lib, "ce_linear_bf16") and lib.ce_amx_init() == 0


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The [N, K] bf16 weight in the AMX kernel's panel layout, or None when that kernel does not apply
    (no AMX, or K not a multiple of 32)."""
    n, k = weight.shape
    if not amx_available() or weight.dtype != torch.bfloat16 or k % 32:
        return None
    lib = library()
    weight = weight.detach().contiguous()
    packed = torch.empty(lib.ce_packed_bf16_size(n, k), dtype=torch.bfloat16)
    lib.ce_pack_bf16_weight(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) in bf16 from `pack_bf16_weight(weight)` of the [n, K] weight."""
    k = x.shape[-1]
    flat = x.dim() == 2 and x.is_contiguous()  # the graphs' case: no reshape (each costs ~1 us per call)
    rows = x if flat else x.reshape(-1, k).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
    if rows.shape[0]:
        bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        bias_ptr = None if bias is None else bias.data_ptr()
        library().ce_linear_bf16(rows.data_ptr(), packed.data_ptr(), bias_ptr, out.data_ptr(), rows.shape[0], n, k)
    return out if flat else out.view(*x.shape[:-1], n)


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of a 2-D CPU tensor (the first maximum, or the first NaN), or None when the
    native path does not apply (any other device, dtype or shape)."""
    code = _DTYPE_CODES.get(x.dtype)
    if x.device.type != "cpu" or code is None or x.dim() != 2 or x.shape[1] == 0:
        return None
    lib = library()
    if lib is None:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.ce_argmax(code, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int, soft_cap: float,
) -> torch.Tensor | None:
    """Paged decode attention, or None when the native path does not apply."""
    lib = library()
    code = _DTYPE_CODES.get(q.dtype)
    if lib is None or code is None or not (k_cache.dtype == v_cache.dtype == q.dtype):
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    q = q.contiguous()
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    lib.ce_decode_attention(
        code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.stride(0),
        lens.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[1], dim, k_cache.shape[0], scale,
        sliding_window, soft_cap,
    )
    return out


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int, soft_cap: float,
) -> torch.Tensor | None:
    """Paged causal attention of each request's new tokens (bf16, AMX), or None when the native path does
    not apply: no AMX, another dtype, a sliding window, a soft cap, or a head size not a multiple of 64."""
    dim = q.shape[-1]
    if sliding_window > 0 or soft_cap > 0 or dim % 64 or not amx_available():
        return None
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    q = _token_rows(q)
    table = page_table.to(torch.int32).contiguous()
    cu = cu_q_lens.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tokens, heads, _ = q.shape
    covered = int(cu[-1])
    if covered < tokens:  # rows of no request (padding) read as zeros, as on the torch path
        out[covered:] = 0
    bad = library().ce_extend_attention_bf16(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.stride(0),
        cu.data_ptr(), lens.data_ptr(), out.data_ptr(), lens.numel(), heads, k_cache.shape[1], dim,
        k_cache.shape[0], scale,
    )
    return None if bad else out


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> bool:
    """Scatter k, v rows into the caches; False when the native path does not apply (nothing written).
    k and v may be token-strided views (slices of a fused QKV output): each token's [Hkv, D] block must be
    contiguous."""
    lib = library()
    if lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        return False
    k, v, slots = _token_rows(k), _token_rows(v), slots.to(torch.int64).contiguous()
    row = k_cache.stride(0)
    bad = lib.ce_store_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                          v.stride(0), slots.data_ptr(), slots.numel(), row, k_cache.element_size(),
                          k_cache.shape[0])
    if bad:
        raise IndexError(f"store_kv: {bad} slot(s) out of range for a cache of {k_cache.shape[0]} slots")
    return True


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] with each token's block contiguous (any token stride), copying only if needed."""
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
