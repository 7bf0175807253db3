"""Inductor checks which vector ISAs the CPU supports on every start by building a probe and loading
it in a subprocess per ISA (about 2 s on 2 cores). A warm-up records the answer in its cache entry;
a warm start skips the probe (`cpp.vec_isa_ok`: trust /proc/cpuinfo) when that gives the recorded
answer."""

from __future__ import annotations

import json
import logging

import torch._inductor.config as inductor_config
from torch._inductor import cpu_vec_isa

from compiled_engine.runner.compile_cache.entry import CacheEntry

log = logging.getLogger(__name__)

FILE = "vec_isa.json"


def record(entry: CacheEntry) -> None:
    """Write the ISAs this process found valid, if it has checked them (compiled or loaded CPU
    code)."""
    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        (entry.path / FILE).write_text(json.dumps(_valid()))


def reuse(entry: CacheEntry) -> bool:
    """Skip the probes if /proc/cpuinfo alone gives the ISAs the warm-up recorded; else leave them
    on."""
    try:
        recorded = json.loads((entry.path / FILE).read_text())
    except (OSError, ValueError):
        return False
    before = inductor_config.cpp.vec_isa_ok
    inductor_config.cpp.vec_isa_ok = True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if _valid() == recorded:
        return True
    log.info(
        "compile cache %s: CPU vector ISAs differ from the warm-up's %s; probing them",
        entry.digest,
        recorded,
    )
    inductor_config.cpp.vec_isa_ok = before
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    return False


def _valid() -> list[str]:
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
