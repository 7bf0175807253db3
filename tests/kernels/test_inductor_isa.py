"""`kernels.cpu.inductor_isa` takes inductor's x86 ISAs above the plan's out of the list inductor
picks from, whatever this machine is: an AMX Xeon's flags injected at each level."""

from __future__ import annotations

import pytest
from torch._inductor import cpu_vec_isa

from kernels.cpu import inductor_isa, isa
from tests.helpers.cpu_families import FAMILIES


@pytest.mark.parametrize(("level", "kept"), [
    ("native", isa.INDUCTOR_LADDER),
    ("avx512", isa.INDUCTOR_LADDER[:3]),
    ("avx2", isa.INDUCTOR_LADDER[:1]),
])
def test_an_amx_xeon_keeps_the_isas_up_to_its_level(monkeypatch, level: str, kept: tuple) -> None:
    monkeypatch.setenv(isa.ENV, level)
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "cpu_flags", lambda: set(FAMILIES["amx_xeon"]))
    before = [str(vec) for vec in cpu_vec_isa.supported_vec_isa_list]
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list",
                        list(cpu_vec_isa.supported_vec_isa_list))
    try:
        inductor_isa.apply()
        names = [str(vec) for vec in cpu_vec_isa.supported_vec_isa_list]
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    assert [n for n in names if n in isa.INDUCTOR_LADDER] == sorted(kept, key=len, reverse=True)
    others = [n for n in before if n not in isa.INDUCTOR_LADDER]  # ARM's, s390's: untouched
    assert [n for n in names if n not in isa.INDUCTOR_LADDER] == others
