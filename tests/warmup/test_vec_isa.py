"""A warm start skips inductor's CPU vector-ISA probes only when /proc/cpuinfo gives the ISAs its
warm-up recorded. No probe runs here: with `vec_isa_ok` set, inductor reads /proc/cpuinfo only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch._inductor.config as inductor_config
from torch._inductor import cpu_vec_isa

from compiled_engine.runner.compile_cache import CacheEntry, vec_isa


@pytest.fixture
def entry(tmp_path: Path) -> Iterator[CacheEntry]:
    entry = CacheEntry(tmp_path, "digest")
    entry.path.mkdir()
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        yield entry
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def cpuinfo_isas() -> list[str]:
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    return isas


def test_the_recorded_isas_skip_the_probes(entry: CacheEntry) -> None:
    (entry.path / vec_isa.FILE).write_text(json.dumps(cpuinfo_isas()))
    assert vec_isa.reuse(entry)
    assert inductor_config.cpp.vec_isa_ok is True


@pytest.mark.parametrize("recorded", [None, "not json", json.dumps(["an ISA the probes rejected"])])
def test_otherwise_the_probes_stay_on(entry: CacheEntry, recorded: str | None) -> None:
    if recorded is not None:
        (entry.path / vec_isa.FILE).write_text(recorded)
    assert not vec_isa.reuse(entry)
    assert inductor_config.cpp.vec_isa_ok is None
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0


def test_nothing_is_recorded_before_the_isas_were_checked(entry: CacheEntry) -> None:
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    vec_isa.record(entry)
    assert not (entry.path / vec_isa.FILE).exists()
