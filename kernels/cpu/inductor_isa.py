"""Holds inductor's vector ISA to the plan of `COMPILED_ENGINE_CPU_ISA` (`isa.IsaPlan`). Inductor
picks the first valid ISA whose name contains `ATEN_CPU_CAPABILITY`'s; under `avx512` on an AMX CPU
that is its AMX one (`avx512 avx512_vnni amx_tile`), so the x86 ISAs above the plan's are taken out
of the list it picks from."""

from __future__ import annotations

from torch._inductor import cpu_vec_isa

from kernels.cpu import isa


def apply() -> None:
    """Cap inductor at the requested level's vector ISA (no change at a level that caps nothing)."""
    plan = isa.here()
    chosen = plan.inductor_vec_isa
    if plan.level == "native" or chosen is None:
        return
    above = isa.INDUCTOR_LADDER[isa.INDUCTOR_LADDER.index(chosen) + 1:] if chosen else \
        isa.INDUCTOR_LADDER
    supported = cpu_vec_isa.supported_vec_isa_list
    kept = [vec for vec in supported if str(vec) not in above]
    if len(kept) != len(supported):
        supported[:] = kept
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
