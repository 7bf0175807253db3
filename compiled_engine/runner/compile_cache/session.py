"""Compiling an engine against its cache entry: verify the entry, point torch's caches at it,
compile, classify the start (hit / partial / miss) from torch's cache counters, and seal a complete
entry."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from compiled_engine.models.demo import cache_root
from compiled_engine.runner import precompiled
from compiled_engine.runner.compile_cache import vec_isa
from compiled_engine.runner.compile_cache.entry import CacheEntry, list_entries
from compiled_engine.runner.compile_cache.key import CacheKey

log = logging.getLogger(__name__)


def default_root(override: str | None = None) -> Path:
    """`override` (`--cache-dir`, `EngineConfig.compile_cache_dir`), else `cache_root()/compile`."""
    return Path(override).expanduser() if override else cache_root() / "compile"


@dataclass
class CacheCounts:
    """What decides hit/miss: graphs loaded precompiled or from the inductor FX graph cache (hits),
    graphs compiled ahead of time or FX graph cache misses and bypasses (misses: code was generated
    and built). AOT autograd cache lookups are informative only."""

    hits: int = 0
    misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    precompiled: int = 0  # of the hits, graphs loaded precompiled (no dynamo tracing)

    @staticmethod
    def now() -> CacheCounts:
        fx, aot, pre = counters["inductor"], counters["aot_autograd"], precompiled.counts
        return CacheCounts(
            fx["fxgraph_cache_hit"] + pre["loaded"],
            fx["fxgraph_cache_miss"] + fx["fxgraph_cache_bypass"] + pre["compiled"],
            aot["autograd_cache_hit"],
            aot["autograd_cache_miss"] + aot["autograd_cache_bypass"],
            pre["loaded"],
        )

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(*(a - b for a, b in zip(astuple(self), astuple(other))))


@dataclass
class CompileReport:
    status: str  # hit: a complete entry served every graph | partial: some graphs compiled | miss
    entry: CacheEntry
    compile_s: float
    counts: CacheCounts
    rebuilt: str | None = None  # why an existing entry was discarded first

    def summary(self) -> str:
        why = f" (discarded: {self.rebuilt})" if self.rebuilt else ""
        c = self.counts
        return (
            f"compile cache {self.status}{why}: {self.entry.path}; compiled in "
            f"{self.compile_s:.1f}s ({c.hits} graph hits ({c.precompiled} precompiled) / "
            f"{c.misses} misses, AOT autograd cache {c.aot_hits} / {c.aot_misses})"
        )


def compile_with_cache(key: CacheKey, root: Path, compile_fn: Callable[[], None]) -> CompileReport:
    """Run `compile_fn` (the warm-up) with torch's caches in the key's entry, under the entry's
    lock."""
    entry = CacheEntry(root, key.digest)
    with entry.locked():
        problem = entry.problem()
        rebuilt = None
        if problem is not None and entry.path.exists():
            log.warning("compile cache %s: %s; rebuilding it", entry.digest, problem)
            entry.wipe()
            rebuilt = problem
        if problem is not None:
            log.warning(
                "compiling the model's graphs for this machine and settings (%s). A one-time cost: "
                "later starts load them from %s",
                rebuilt or miss_reason(root, key),
                entry.path,
            )
        use_entry(entry)
        if problem is None and key.device.startswith("cpu"):
            vec_isa.reuse(entry)
        before = CacheCounts.now()
        t0 = time.perf_counter()
        compile_fn()
        compile_s = time.perf_counter() - t0
        counts = CacheCounts.now() - before
        if problem is None and counts.misses == 0:
            status = "hit"
        else:
            status = "partial" if counts.hits else "miss"
            vec_isa.record(entry)
            entry.write_manifest(key, compile_s)
    report = CompileReport(status, entry, compile_s, counts, rebuilt)
    log.info("%s", report.summary())
    return report


def miss_reason(root: Path, key: CacheKey) -> str:
    """Why no entry serves `key`: the key fields in which the nearest complete entry differs."""
    # as a manifest holds them (tuples are lists there)
    fields = json.loads(json.dumps(key.fields()))
    nearest: tuple[int, str, list[str]] | None = None
    for other in list_entries(root):
        theirs = (other.read_manifest() or {}).get("key")
        if other.digest == key.digest or not isinstance(theirs, dict):
            continue
        diff = [f"{name} {theirs.get(name)!r} -> {value!r}" for name, value in fields.items()
                if theirs.get(name) != value]
        if nearest is None or len(diff) < nearest[0]:
            nearest = (len(diff), other.digest, diff)
    if nearest is None:
        return f"the cache {root} holds no entry yet"
    if any(d.startswith("model_config ") for d in nearest[2]):
        return "no entry for this model yet"
    return f"the nearest entry, {nearest[1]}, differs in " + "; ".join(nearest[2])


def use_entry(entry: CacheEntry) -> None:
    """Point inductor's FX graph cache, AOT autograd cache and Triton's cache at `entry` (taking
    precedence over a TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR set for the whole process)."""
    from torch._inductor.utils import clear_caches

    entry.path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(entry.inductor_dir)
    os.environ["TRITON_CACHE_DIR"] = str(entry.triton_dir)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    # in-memory caches of compiled modules would otherwise skip writing to the new folder
    clear_caches()
