"""Attention kernels: torch.library custom ops (``kernels.ops``), Triton kernels and a torch reference.

Importing the package applies `COMPILED_ENGINE_CPU_ISA` (see `kernels.cpu_isa`): the engine imports it
before any op runs, which is before oneDNN and ATen read their ISA caps."""

from kernels import cpu_isa

cpu_isa.apply()
