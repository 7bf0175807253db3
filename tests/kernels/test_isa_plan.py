"""`kernels.cpu.isa.plan`: what each ISA-picking layer (our native kernels' gcc flags, oneDNN, ATen,
inductor) gets on each CPU family at each `COMPILED_ENGINE_CPU_ISA` level, from injected
/proc/cpuinfo flags, so that every family is checked on every machine (the real probe of the
machine at hand is tests/kernels/test_cpu_isa.py)."""

from __future__ import annotations

import pytest

from kernels.cpu import isa
from tests.helpers.cpu_families import FAMILIES

ARM = {"fp", "asimd", "sve", "bf16", "i8mm"}
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
BELOW_AVX2 = (*NO_AMX, "-mno-avx512f", "-mno-avxvnni")

# (family, level) -> (effective level, gcc flags after -march=native, oneDNN, ATen, inductor)
EXPECTED = {
    ("amx_xeon", "native"): ("native", (), None, None, "avx512 avx512_vnni amx_tile"),
    ("amx_xeon", "avx512"): ("avx512", NO_AMX, "AVX512_CORE_BF16", "avx512", "avx512 avx512_vnni"),
    ("amx_xeon", "avx2"): ("avx2", BELOW_AVX2, "AVX2", "avx2", "avx2"),
    ("zen4", "native"): ("native", (), None, None, "avx512 avx512_vnni"),
    ("zen4", "avx512"): ("native", (), None, None, "avx512 avx512_vnni"),
    ("zen4", "avx2"): ("avx2", BELOW_AVX2, "AVX2", "avx2", "avx2"),
    ("skylake_x", "native"): ("native", (), None, None, "avx512"),
    ("skylake_x", "avx512"): ("native", (), None, None, "avx512"),
    ("skylake_x", "avx2"): ("avx2", BELOW_AVX2, "AVX2", "avx2", "avx2"),
    ("knl", "native"): ("native", (), None, None, "avx2"),
    ("knl", "avx512"): ("native", (), None, None, "avx2"),
    ("knl", "avx2"): ("avx2", BELOW_AVX2, "AVX2", "avx2", "avx2"),
    ("zen3", "native"): ("native", (), None, None, "avx2"),
    ("zen3", "avx512"): ("native", (), None, None, "avx2"),
    ("zen3", "avx2"): ("native", (), None, None, "avx2"),
}


@pytest.mark.parametrize(("family", "level"), sorted(EXPECTED))
def test_each_x86_family_at_each_level(family: str, level: str) -> None:
    got = isa.plan(FAMILIES[family], level, "x86_64")
    effective, gcc, onednn, aten, inductor = EXPECTED[family, level]
    assert got == isa.IsaPlan(effective, ("-march=native", *gcc), onednn, aten, inductor)
    assert got.env() == {k: v for k, v in (("ONEDNN_MAX_CPU_ISA", onednn),
                                           ("ATEN_CPU_CAPABILITY", aten)) if v is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_level_caps_and_never_adds(family: str) -> None:
    """Down the levels, the inductor ISA never climbs the ladder and no AMX appears below native."""
    ladder = ["", *isa.INDUCTOR_LADDER]
    plans = [isa.plan(FAMILIES[family], name, "x86_64") for name in isa.LEVELS]
    ranks = [ladder.index(p.inductor_vec_isa) for p in plans]
    assert ranks == sorted(ranks, reverse=True)
    for p in plans[1:]:
        assert "amx" not in p.inductor_vec_isa
        if p.level != "native":  # a level that caps takes AMX out of the native kernels' build
            assert "-mno-amx-tile" in p.gcc_flags


@pytest.mark.parametrize("level", isa.LEVELS)
def test_arm_runs_what_it_has_at_every_level(level: str) -> None:
    assert isa.plan(ARM, level, "aarch64") == isa.IsaPlan("native", ("-march=native",), None, None,
                                                          None)


def test_an_unknown_level_names_the_choices() -> None:
    with pytest.raises(ValueError, match="use one of native, avx512, avx2"):
        isa.plan(FAMILIES["zen4"], "sse9", "x86_64")


def test_the_reruns_are_the_levels_that_change_something(monkeypatch) -> None:
    """`make test` reruns the suite at each level below native that changes a layer's choice."""
    expected = {"amx_xeon": ["avx512", "avx2"], "zen4": ["avx2"], "skylake_x": ["avx2"],
                "knl": ["avx2"], "zen3": []}
    monkeypatch.delenv(isa.ENV, raising=False)
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    for family, below in expected.items():
        monkeypatch.setattr(isa, "cpu_flags", lambda f=FAMILIES[family]: set(f))
        assert isa.levels_below_native() == below, family
    monkeypatch.setattr(isa, "cpu_flags", lambda: set(FAMILIES["amx_xeon"]))
    monkeypatch.setenv(isa.ENV, "avx512")  # asked for a level: the reruns go below it only
    assert isa.levels_below_native() == ["avx2"]
    monkeypatch.setenv(isa.ENV, "avx2")
    assert isa.levels_below_native() == []
    monkeypatch.delenv(isa.ENV)
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(isa, "cpu_flags", lambda: set(ARM))
    assert isa.levels_below_native() == []
