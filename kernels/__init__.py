"""The kernels: torch.library ops (`kernels.ops`, the only entry point) served by the Triton kernels
on CUDA (`kernels.triton`), the native C++ kernels on the CPU (`kernels.cpu`) and portable torch
code elsewhere (`kernels.portable`); `kernels.reference` is the slow, obviously-correct oracle of
the tests.

Importing the package does nothing else. `init(device)`, called once by whatever builds an engine
before the first op runs, applies `COMPILED_ENGINE_CPU_ISA` (see `kernels.cpu.isa`; a process entry
point applies it earlier still, before torch first dispatches) and, for the CPU, holds inductor's
vector ISA to it and builds and loads the native kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def apply_isa_caps() -> None:
    """Export the oneDNN / ATen caps of `COMPILED_ENGINE_CPU_ISA`'s level (a variable the user set
    stays as set). Imports no torch: a process entry point calls it first, before torch first
    dispatches."""
    from kernels.cpu import isa

    isa.apply()


def init(device: torch.device | str = "cpu") -> bool:
    """Make the ops ready to serve `device`. Returns whether the native CPU kernels serve the CPU
    (False for a device that is not the CPU, and where the portable implementations do: no compiler,
    a failed build, `COMPILED_ENGINE_NATIVE=0`). Idempotent."""
    import torch

    from kernels import ops

    apply_isa_caps()
    if torch.device(device).type != "cpu":
        return False
    from kernels.cpu import inductor_isa

    inductor_isa.apply()
    return ops.load_cpu_kernels()
