"""One switch for every CPU code path that depends on the instruction set:
`COMPILED_ENGINE_CPU_ISA`.

    native   (default) everything this CPU has: AMX tiles, AVX512-BF16, ...
    avx512   no AMX: what an AMD Zen4 runs
    avx2     no AVX512 either: what older x86 runs (and, for our kernels, ARM: their portable C++
             paths)

A level caps, it never adds: `avx512` on an AVX2-only CPU runs AVX2. It reaches the three places
that pick code by ISA: our native kernels (`-mno-...` on top of `-march=native`: the C++ takes its
non-AMX / non-AVX512 branches), oneDNN (`ONEDNN_MAX_CPU_ISA`, read at its first use) and ATen's
kernels plus inductor's generated C++ (`ATEN_CPU_CAPABILITY`, read by ATen once and by inductor at
each compile). This module imports no torch: `apply()` must run before torch first dispatches
(`kernels.apply_isa_caps()`, which each process entry point calls first, and `kernels.init`;
`tests/conftest.py` before it imports torch); a variable the user set stays as set.
"""

from __future__ import annotations

import os
import platform

ENV = "COMPILED_ENGINE_CPU_ISA"
LEVELS = ("native", "avx512", "avx2")  # from most to least capable
PORTABLE = "avx2"  # the level every x86 CPU runs (and ARM's code paths)
_NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
_GCC_FLAGS = {"native": [], "avx512": _NO_AMX, "avx2": [*_NO_AMX, "-mno-avx512f"]}
_ENV_CAPS = {
    "native": {},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def level() -> str:
    """The requested level (ValueError naming the choices for anything else)."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(LEVELS)}")
    return value


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def env_caps(name: str) -> dict[str, str]:
    """The environment that caps a new process at level `name`: the switch itself, and off x86
    nothing more."""
    return {ENV: name, **_ENV_CAPS[name]} if _x86() else {ENV: name}


def apply() -> None:
    """Export the oneDNN / ATen caps of the requested level (before torch first runs)."""
    if _x86():
        for var, value in _ENV_CAPS[level()].items():
            os.environ.setdefault(var, value)


def levels_below_native() -> list[str]:
    """The levels that change something on this CPU (an AMX machine: avx512 and avx2; an AVX512 one
    without AMX: avx2; an AVX2-only or non-x86 one: none, it runs the portable paths natively)."""
    if not _x86():
        return []
    flags = cpu_flags()
    below = []
    if "amx_bf16" in flags:
        below.append("avx512")
    if "avx512f" in flags:
        below.append("avx2")
    return below


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler_flags() -> list[str]:
    """Target flags of the native kernels at the requested level (x86 only: the -mno- flags are
    x86's)."""
    return ["-march=native", *(_GCC_FLAGS[level()] if _x86() else [])]

