"""One switch for every CPU code path that depends on the instruction set:
`COMPILED_ENGINE_CPU_ISA`.

    native   (default) everything this CPU has: AMX tiles, AVX512-BF16, ...
    avx512   no AMX: what an AMD Zen4 runs
    avx2     no AVX512 either: what older x86 runs (and, for our kernels, ARM: their portable C++
             paths)

A level caps, it never adds: `avx512` on an AVX2-only CPU runs AVX2. `plan(flags, level, machine)`
is the whole decision, a pure function from the CPU's flags and the level to what each layer that
picks code by ISA gets: our native kernels (`-mno-...` on top of `-march=native`: the C++ takes its
non-AMX / non-AVX512 branches), oneDNN (`ONEDNN_MAX_CPU_ISA`, read at its first use), ATen's kernels
(`ATEN_CPU_CAPABILITY`, read once) and inductor's vector ISA (the ISA its generated C++ is built
for; `kernels.cpu.inductor_isa` holds inductor to it). This module imports no torch: `apply()` must
run before torch first dispatches (`kernels.apply_isa_caps()`, which each process entry point calls
first, and `kernels.init`; `tests/conftest.py` before it imports torch); a variable the user set
stays as set."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass

ENV = "COMPILED_ENGINE_CPU_ISA"
LEVELS = ("native", "avx512", "avx2")  # from most to least capable
PORTABLE = "avx2"  # the level every x86 CPU runs (and ARM's code paths)
X86_MACHINES = ("x86_64", "amd64", "i686", "x86")
# inductor's x86 vector ISAs (`str(VecISA)`), least capable first
INDUCTOR_LADDER = ("avx2", "avx512", "avx512 avx512_vnni", "avx512 avx512_vnni amx_tile")
_AVX512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl"}  # what ATen and inductor call AVX512
_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


@dataclass(frozen=True)
class IsaPlan:
    """What each ISA-picking layer gets. `None`: left to the layer's own choice (the CPU's best)."""

    level: str  # the effective level: the requested one, lowered to what the CPU has
    gcc_flags: tuple[str, ...]  # target flags of our native kernels
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA
    aten_capability: str | None  # ATEN_CPU_CAPABILITY
    inductor_vec_isa: str | None  # inductor's vector ISA, one of INDUCTOR_LADDER ("" for none)

    def env(self) -> dict[str, str]:
        """The environment variables that carry the caps to oneDNN and ATen."""
        caps = {"ONEDNN_MAX_CPU_ISA": self.onednn_max_isa,
                "ATEN_CPU_CAPABILITY": self.aten_capability}
        return {var: value for var, value in caps.items() if value is not None}


def top_level(flags: Iterable[str], machine: str) -> str:
    """The most capable level a CPU with these flags has ("avx2" off x86: the portable paths)."""
    flags = set(flags)
    if machine.lower() not in X86_MACHINES or "avx512f" not in flags:
        return "avx2"  # (an AVX512F-only CPU such as Knights Landing is an avx512 one to gcc)
    return "native" if "amx_tile" in flags else "avx512"


def _inductor_best(flags: set[str]) -> str:
    if flags >= _AVX512:
        if "avx512_vnni" not in flags:
            return "avx512"
        return INDUCTOR_LADDER[3] if "amx_tile" in flags else INDUCTOR_LADDER[2]
    return "avx2" if "avx2" in flags else ""


def plan(flags: Iterable[str], level: str, machine: str) -> IsaPlan:
    """What each layer gets on a CPU with `flags` (/proc/cpuinfo's names) at `level`. Off x86 the
    levels change nothing: every layer runs what the CPU has (our kernels' portable C++ paths)."""
    if level not in LEVELS:
        raise ValueError(f"{ENV}={level!r}: use one of {', '.join(LEVELS)}")
    flags = set(flags)
    if machine.lower() not in X86_MACHINES:
        return IsaPlan("native", ("-march=native",), None, None, None)
    top = top_level(flags, machine)
    effective = max(level, top, key=LEVELS.index)  # the less capable of the two
    best = _inductor_best(flags)
    if effective == top:  # nothing to cap: every layer takes this CPU's best
        return IsaPlan("native", ("-march=native",), None, None, best)
    if effective == "avx512":
        inductor = best.replace(" amx_tile", "")
        return IsaPlan(effective, ("-march=native", *_NO_AMX), "AVX512_CORE_BF16", "avx512",
                       inductor)
    inductor = "avx2" if "avx2" in flags else ""
    return IsaPlan(effective, ("-march=native", *_NO_AMX, "-mno-avx512f", "-mno-avxvnni"), "AVX2",
                   "avx2", inductor)


def level() -> str:
    """The requested level (ValueError naming the choices for anything else)."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(LEVELS)}")
    return value


def here(name: str | None = None) -> IsaPlan:
    """The plan of this CPU at level `name` (the requested level by default)."""
    return plan(cpu_flags(), name or level(), platform.machine())


def env_caps(name: str) -> dict[str, str]:
    """The environment that caps a new process at level `name` on this CPU: the switch itself and
    the oneDNN / ATen caps of the plan."""
    return {ENV: name, **here(name).env()}


def apply() -> None:
    """Export the oneDNN / ATen caps of the requested level (before torch first runs)."""
    for var, value in here().env().items():
        os.environ.setdefault(var, value)


def levels_below_native() -> list[str]:
    """The levels below the requested one (native by default) that change something on this CPU
    (natively: an AMX machine avx512 and avx2; an AVX512 one without AMX avx2; an AVX2-only or
    non-x86 one none, it runs the portable paths natively)."""
    asked = here()
    return [name for name in LEVELS[LEVELS.index(level()) + 1:] if here(name) != asked]


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler_flags() -> list[str]:
    """Target flags of the native kernels at the requested level."""
    return list(here().gcc_flags)


def is_x86() -> bool:
    return platform.machine().lower() in X86_MACHINES
