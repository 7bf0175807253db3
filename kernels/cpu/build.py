"""The native CPU kernels of `native/` built into one library against this torch with the system C++
compiler, on first CPU use (cached under inductor's default cache folder by a hash of the sources,
flags, compiler, torch and CPU), and loaded: loading registers their C++ kernels for the `kernels::`
ops (native/torch_ops.cpp), the only binding. Without a compiler, or with
`COMPILED_ENGINE_NATIVE=0`, the ops' portable torch implementations serve the CPU instead.
"""

from __future__ import annotations

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

from kernels.cpu import isa as cpu_isa

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
SOURCES = [
    NATIVE / name
    for name in (
        "attention.cpp",
        "extend_attention.cpp",
        "invariant_attention.cpp",
        "invariant_linear.cpp",
        "invariant_linear_dpbf16.cpp",
        "linear.cpp",
        "lora.cpp",
        "packed_linear.cpp",
        "packed_linear_x16.cpp",
        "sampling.cpp",
        "torch_ops.cpp",
    )
]
HEADERS = [NATIVE / "common.h", NATIVE / "packed_acts.h"]
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # + cpu_isa.compiler_flags()


def _torch_flags() -> list[str]:
    """Compiling and linking against this torch (torch_ops.cpp registers the kernels with its
    dispatcher)."""
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

def _build(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    texts = [path.read_text() for path in SOURCES + HEADERS]
    flags = FLAGS + cpu_isa.compiler_flags() + _torch_flags()
    cpu = " ".join(sorted(cpu_isa.cpu_flags())) or platform.processor()
    parts = [*texts, *flags, version, torch.__version__, cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    # inductor's default folder, not its current one: the compile cache repoints
    # TORCHINDUCTOR_CACHE_DIR at each entry, and processes started from there (TP ranks) would build
    # the library once per entry
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    target = Path(default_cache_dir()) / "compiled_engine_native" / f"cpu_native-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *map(str, SOURCES), *flags, "-o", tmp],
                capture_output=True,
                text=True,
                check=True,
            )
            # atomic: a concurrent build of the same key writes the same bytes
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def load() -> bool:
    """Build (once per key) and load the library: True when its kernels now serve the CPU (logged
    once when they cannot)."""
    if os.environ.get("COMPILED_ENGINE_NATIVE", "1") == "0":
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found: the CPU ops use their portable torch implementations")
        return False
    try:
        torch.ops.load_library(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning(
            "building the native CPU kernels failed, using the portable ones: %s", detail[-2000:]
        )
        return False
    return True


def compiled_isa() -> set[str] | None:
    """The ISA extensions the loaded library was built with (None without the library)."""
    if not load():
        return None
    mask = torch.ops.kernels.native_isa()
    return {
        name for bit, name in enumerate(("avx512f", "avx512bf16", "amx_bf16")) if mask >> bit & 1
    }


def amx_available() -> bool:
    """Whether the AMX bf16 kernels (linear, extend attention) run here: built for AMX, and Linux
    granted this process the tile state."""
    return load() and bool(torch.ops.kernels.native_isa() & 8)
