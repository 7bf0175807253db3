"""The native CPU kernels of `kernels/native/` (attention.cpp: decode attention and the KV store;
extend_attention.cpp: AMX flash attention for prefill / extend; linear.cpp: the AMX bf16 linear;
sampling.cpp: the greedy argmax; torch_ops.cpp: the CPU kernels of the kernels:: ops on top of them),
built into one library against this torch with the system C++ compiler on first use (~15 s, cached
under inductor's default cache folder by a hash of the sources, flags, compiler, torch and CPU). Loading it
registers the ops' C++ kernels; the functions here reach the weight packing, the linear (for the ops'
torch fallback) and the argmax (for the sampler) through ctypes, which releases the GIL. They return None
when the library is unavailable (no compiler, `COMPILED_ENGINE_NATIVE=0`), and the torch implementations
serve instead.
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

from kernels import cpu_isa

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
SOURCES = [
    NATIVE / name
    for name in ("attention.cpp", "extend_attention.cpp", "linear.cpp", "sampling.cpp", "torch_ops.cpp")
]
HEADERS = [NATIVE / "common.h"]
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # + cpu_isa.compiler_flags()


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
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [path.read_text() for path in SOURCES + HEADERS]
    flags = FLAGS + cpu_isa.compiler_flags() + _torch_flags()
    cpu = " ".join(sorted(cpu_isa.cpu_flags())) or platform.processor()
    parts = [*texts, *flags, version, torch.__version__, cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    # inductor's default folder, not its current one: the compile cache repoints TORCHINDUCTOR_CACHE_DIR at
    # each entry, and processes started from there (TP ranks) would build the library once per entry
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    target = Path(default_cache_dir()) / "compiled_engine_native" / f"cpu_native-{key}.so"
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
    lib.ce_amx_init.restype = ctypes.c_int
    lib.ce_compiled_isa.restype = ctypes.c_int
    lib.ce_argmax.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr]
    lib.ce_argmax.restype = ctypes.c_int
    if hasattr(lib, "ce_linear_bf16"):  # built only where the compiler targets AMX
        lib.ce_packed_bf16_size.argtypes = [_i64, _i64]
        lib.ce_packed_bf16_size.restype = _i64
        lib.ce_pack_bf16_weight.argtypes = [_ptr, _ptr, _i64, _i64]
        lib.ce_linear_bf16.argtypes = [*[_ptr] * 4, _i64, _i64, _i64]
    return lib


def compiled_isa() -> set[str] | None:
    """The ISA extensions the loaded library was built with (None without the library)."""
    lib = library()
    if lib is None:
        return None
    mask = lib.ce_compiled_isa()
    return {name for bit, name in enumerate(("avx512f", "avx512bf16", "amx_bf16")) if mask >> bit & 1}


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
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
    if rows.shape[0]:
        bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        bias_ptr = None if bias is None else bias.data_ptr()
        library().ce_linear_bf16(rows.data_ptr(), packed.data_ptr(), bias_ptr, out.data_ptr(), rows.shape[0], n, k)
    return out.view(*x.shape[:-1], n)


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
