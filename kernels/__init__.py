"""The kernels: torch.library ops (`kernels.ops`, the only entry point) served by the Triton kernels on CUDA
(`kernels.triton`), the native C++ kernels on the CPU (`kernels.cpu`) and portable torch code elsewhere
(`kernels.portable`); `kernels.reference` is the slow, obviously-correct oracle of the tests.

Importing the package applies `COMPILED_ENGINE_CPU_ISA` (see `kernels.cpu.isa`): the engine imports it
before any op runs, which is before oneDNN and ATen read their ISA caps."""

from kernels.cpu import isa

isa.apply()
