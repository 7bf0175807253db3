"""Cache entries without compiling: torch's cache folder goes to the entry, a complete warm-up seals
it with a manifest, and a damaged entry is detected and rebuilt. A fake compile stands in for
torch's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from compiled_engine.runner.compile_cache import (
    CacheEntry,
    CacheKey,
    clear_entries,
    compile_with_cache,
    list_entries,
)

KEY = CacheKey(
    model_config="m",
    dtype="float32",
    device="cpu",
    tp_size=1,
    tp_rank=0,
    buckets=(1, 2),
    max_running=4,
    max_context=256,
    page_size=1,
    num_pages=64,
    compile_mode="default",
    deterministic=True,
    weight_layout="dense",
    torch="t",
    triton="tr",
    python="p",
    engine_source="s",
)


def fake_compile() -> None:
    """What inductor does on a cold compile: write into TORCHINDUCTOR_CACHE_DIR, count a miss; or a
    hit when its file is already there."""
    graph = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph" / "graph.bin"
    if graph.exists():
        counters["inductor"]["fxgraph_cache_hit"] += 1
        return
    graph.parent.mkdir(parents=True, exist_ok=True)
    graph.write_bytes(b"compiled code " * 100)
    counters["inductor"]["fxgraph_cache_miss"] += 1


@pytest.fixture
def root(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ci-wide"))  # as CI sets it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "ci-triton"))
    return tmp_path / "compile"


def test_cold_then_warm(root: Path) -> None:
    cold = compile_with_cache(KEY, root, fake_compile)
    assert cold.status == "miss" and cold.rebuilt is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cold.entry.inductor_dir)
    assert cold.entry.problem() is None
    assert (cold.entry.inductor_dir / "fxgraph" / "graph.bin").exists()
    warm = compile_with_cache(KEY, root, fake_compile)
    assert warm.status == "hit" and warm.counts.hits == 1 and warm.counts.misses == 0


def test_a_started_but_unfinished_entry_is_a_miss_and_rebuilt(root: Path) -> None:
    entry = CacheEntry(root, KEY.digest)
    (entry.inductor_dir / "fxgraph").mkdir(parents=True)
    (entry.inductor_dir / "fxgraph" / "graph.bin").write_bytes(b"half")
    report = compile_with_cache(KEY, root, fake_compile)
    assert report.status == "miss" and "no manifest" in report.rebuilt
    assert entry.problem() is None


@pytest.mark.parametrize("damage", ["truncate", "garble", "delete", "manifest"])
def test_a_damaged_entry_is_detected_and_rebuilt(root: Path, damage: str) -> None:
    entry = compile_with_cache(KEY, root, fake_compile).entry
    graph = entry.inductor_dir / "fxgraph" / "graph.bin"
    if damage == "truncate":
        graph.write_bytes(graph.read_bytes()[:10])
    elif damage == "garble":
        graph.write_bytes(b"x" * graph.stat().st_size)
    elif damage == "delete":
        graph.unlink()
    else:
        (entry.path / "manifest.json").write_text('{"version": 1, "files": ')
    assert entry.problem() is not None
    report = compile_with_cache(KEY, root, fake_compile)
    assert report.status == "miss" and report.rebuilt
    assert entry.problem() is None and graph.read_bytes() == b"compiled code " * 100


def test_a_failed_warm_up_leaves_no_manifest(root: Path) -> None:
    def broken() -> None:
        fake_compile()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        compile_with_cache(KEY, root, broken)
    assert "no manifest" in CacheEntry(root, KEY.digest).problem()


def test_list_and_clear_by_prefix(root: Path) -> None:
    other = KEY.__class__(**(KEY.fields() | {"dtype": "bfloat16"}))
    compile_with_cache(KEY, root, fake_compile)
    compile_with_cache(other, root, fake_compile)
    assert sorted(e.digest for e in list_entries(root)) == sorted([KEY.digest, other.digest])
    assert [e.digest for e in clear_entries(root, KEY.digest[:6])] == [KEY.digest]
    assert [e.digest for e in list_entries(root)] == [other.digest]
    clear_entries(root)
    assert list_entries(root) == []


def test_a_concurrent_start_waits_for_the_warm_up_then_hits(root: Path) -> None:
    order: list[str] = []
    locked = threading.Event()

    def slow_compile() -> None:
        locked.set()
        time.sleep(0.3)
        fake_compile()
        order.append("warm-up done")

    first = threading.Thread(target=compile_with_cache, args=(KEY, root, slow_compile))
    first.start()
    locked.wait()
    second = compile_with_cache(KEY, root, lambda: order.append("second start") or fake_compile())
    first.join()
    assert order == ["warm-up done", "second start"] and second.status == "hit"
