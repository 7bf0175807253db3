"""The compile-cache key changes with whatever changes generated code, and with nothing else."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.models.demo import DEMO_CONFIG
from compiled_engine.models.loader import load_config
from compiled_engine.runner.compile_cache import key as key_mod
from compiled_engine.runner.compile_cache.entry import CacheEntry
from compiled_engine.runner.compile_cache.key import CacheKey, cache_key
from compiled_engine.runner.compile_cache.session import miss_reason
from compiled_engine.runner.model_runner import RunnerConfig

CPU = torch.device("cpu")
RUNNER = RunnerConfig(max_rows=4, max_context=256, page_size=1, num_pages=64, buckets=[1, 2])


def write_config(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG | overrides))
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_config(tmp_path / "model")


def digest(config: EngineConfig, model_dir: Path, dtype: torch.dtype = torch.float32,
           runner: RunnerConfig = RUNNER) -> str:
    return key_of(config, model_dir, dtype, runner).digest


def key_of(config: EngineConfig, model_dir: Path, dtype: torch.dtype = torch.float32,
           runner: RunnerConfig = RUNNER, model: torch.nn.Module | None = None) -> CacheKey:
    held = model if model is not None else torch.nn.Module()
    return cache_key(config, load_config(str(model_dir)), dtype, CPU, runner, held)


def test_packed_weights_change_the_key(model_dir: Path) -> None:
    """The graphs call another op for a packed weight, with its format as a constant."""
    from kernels.packed import FORMATS, PackedWeight

    def holding(fmt: str) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight = PackedWeight(torch.zeros(4, FORMATS[fmt].nbytes, dtype=torch.uint8),
                                FORMATS[fmt], 32)
        return m

    config = EngineConfig()
    dense = key_of(config, model_dir).digest
    q4 = key_of(config, model_dir, model=holding("Q4_1")).digest
    assert len({dense, q4, key_of(config, model_dir, model=holding("Q8_0")).digest}) == 3
    assert key_of(config, model_dir, model=holding("Q4_1")).digest == q4


def test_model_config_and_dtype_change_the_key(model_dir: Path, tmp_path: Path) -> None:
    config = EngineConfig()
    base = digest(config, model_dir)
    assert digest(config, model_dir) == base
    assert digest(config, write_config(tmp_path / "deeper", num_hidden_layers=5)) != base
    assert digest(config, model_dir, torch.bfloat16) != base


@pytest.mark.parametrize(
    "change",
    [
        {"buckets": [1, 2, 4]},
        {"max_rows": 8},
        {"max_context": 512},
        {"page_size": 16},
        {"num_pages": 65},
    ],
)
def test_graph_shaping_settings_change_the_key(model_dir: Path, change: dict) -> None:
    base = digest(EngineConfig(), model_dir)
    assert digest(EngineConfig(), model_dir, runner=dataclasses.replace(RUNNER, **change)) != base


def test_tp_size_and_compile_mode_change_the_key(model_dir: Path) -> None:
    base = digest(EngineConfig(), model_dir)
    assert digest(EngineConfig(tp_size=2), model_dir) != base
    assert digest(EngineConfig(compile_mode="freezing"), model_dir) != base


def test_serving_settings_do_not_change_the_key(model_dir: Path) -> None:
    base = digest(EngineConfig(), model_dir)
    serving = EngineConfig(
        extra={"port": 9999, "host": "0.0.0.0", "api_key": "k", "log_level": "debug"},
        seed=7,
        overlap=False,
        chunk_budget=512,
        mixed=False,
        prefix_cache="naive",
        mem_fraction=0.5,
        compile_cache_dir="/elsewhere",
    )
    assert digest(serving, model_dir) == base
    assert digest(EngineConfig(), model_dir, runner=dataclasses.replace(RUNNER, seed=3)) == base


def test_an_engine_source_edit_changes_the_key(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    names = {root.name for root in key_mod.TRACED_SOURCES}
    assert {"models", "layers", "runner", "kernels", "parallel_state.py"} <= names
    # a moved file would silently leave the key
    assert all(root.exists() for root in key_mod.TRACED_SOURCES)
    copy = tmp_path / "src" / "runner"
    shutil.copytree(next(r for r in key_mod.TRACED_SOURCES if r.name == "runner"), copy)
    monkeypatch.setattr(key_mod, "TRACED_SOURCES", (copy,))
    base = digest(EngineConfig(), model_dir)
    sampler = copy / "sampler.py"  # runs outside the graphs
    sampler.write_text(sampler.read_text() + "\n# an edit\n")
    assert digest(EngineConfig(), model_dir) == base
    forward = copy / "compiled_forward.py"
    forward.write_text(forward.read_text() + "\n# an edit\n")
    assert digest(EngineConfig(), model_dir) != base


def test_a_native_kernel_source_edit_changes_the_key(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    kernels = tmp_path / "src" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "ops.py").write_text("OPS = 1\n")
    monkeypatch.setattr(key_mod, "TRACED_SOURCES", (kernels,))
    base = digest(EngineConfig(), model_dir)
    (kernels / "README.txt").write_text("not source\n")
    assert digest(EngineConfig(), model_dir) == base
    (kernels / "native").mkdir()
    (kernels / "native" / "attention.cpp").write_text("int attend() { return 0; }\n")
    assert digest(EngineConfig(), model_dir) != base


def test_the_same_config_in_another_folder_keys_alike(model_dir: Path, tmp_path: Path) -> None:
    assert digest(EngineConfig(), write_config(tmp_path / "elsewhere")) == digest(
        EngineConfig(), model_dir
    )


def test_a_miss_names_what_differs_from_the_nearest_entry(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    assert "holds no entry" in miss_reason(root, key_of(EngineConfig(), model_dir))
    for runner in (RUNNER, dataclasses.replace(RUNNER, num_pages=128, max_rows=8)):
        key = key_of(EngineConfig(), model_dir, runner=runner)
        entry = CacheEntry(root, key.digest)
        entry.path.mkdir(parents=True)
        entry.write_manifest(key, 1.0)
    wanted = key_of(EngineConfig(), model_dir, runner=dataclasses.replace(RUNNER, num_pages=256))
    reason = miss_reason(root, wanted)
    assert "num_pages 64 -> 256" in reason and "max_running" not in reason, reason
    other_model = key_of(EngineConfig(), write_config(tmp_path / "deeper", num_hidden_layers=5))
    assert miss_reason(root, other_model) == "no entry for this model yet"


def test_the_cpu_kv_pool_does_not_follow_free_memory(monkeypatch) -> None:
    """The pool's size is in the key: sized from available memory, a 24 GiB machine's SmolLM2 pool
    flipped between 2^17 and 2^18 pages as other processes took or released a few hundred MB, and
    every flip recompiled."""
    from compiled_engine import startup

    model = type(
        "Model", (), {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": torch.bfloat16}
    )()
    config = startup.resolve_config(EngineConfig(max_running=256), CPU)  # as build_engine
    pages = set()
    for available in (24.6e9, 24.0e9, 22.0e9):
        monkeypatch.setattr(startup, "_host_memory", lambda a=available: (25.28e9, a))
        pages.add(startup.size_kv_pool(config, model, 8192, CPU))
    assert pages == {1 << 18}
    # a busy machine: what is there
    monkeypatch.setattr(startup, "_host_memory", lambda: (25.28e9, 2.0e9))
    assert startup.size_kv_pool(config, model, 8192, CPU) == 1 << 16


def test_a_draft_model_shares_the_pool_budget(monkeypatch) -> None:
    """Speculative decoding with a draft model: its KV uses the same slots, so a slot costs both
    models' bytes and the pool has fewer slots (here: a draft as large as the model, half)."""
    from compiled_engine import startup

    model = type(
        "Model", (), {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": torch.bfloat16}
    )()
    config = startup.resolve_config(EngineConfig(max_running=256), CPU)  # as build_engine
    monkeypatch.setattr(startup, "_host_memory", lambda: (25.28e9, 24.0e9))
    alone = startup.size_kv_pool(config, model, 8192, CPU)
    assert startup.size_kv_pool(config, model, 8192, CPU, draft=model) == alone // 2
