"""Precompiled graphs fall back to torch.compile's lazy graph whenever loading, compiling or a guard
fails. Fake precompiled functions stand in for torch's (the end-to-end path is in
tests/warmup/test_warm_start.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from compiled_engine.runner import precompiled


class FakeAot:
    """What `aot_compile` returns: guards, a call, a save."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.checks = 0

    def disable_guard_check(self) -> None:
        pass

    def guard_check(self, *args) -> bool:
        self.checks += 1
        return self.accepts

    def __call__(self, *args) -> str:
        return "precompiled"

    def save_compiled_function(self, path: str) -> None:
        Path(path).write_bytes(b"saved")


def lazy(*args) -> str:
    return "lazy"


@pytest.fixture(autouse=True)
def counts(monkeypatch) -> Counter:
    monkeypatch.setattr(precompiled, "counts", Counter())
    return precompiled.counts


def test_a_missing_file_is_compiled_and_saved(tmp_path: Path, counts: Counter) -> None:
    path = tmp_path / "pre" / "decode-1.bin"
    graph = precompiled.load_or_compile(FakeAot, lazy, (), path)
    assert graph() == "precompiled" and path.read_bytes() == b"saved"
    assert counts == {"compiled": 1}


def test_an_unloadable_file_is_compiled_again(tmp_path: Path, counts: Counter) -> None:
    path = tmp_path / "extend.bin"
    path.write_bytes(b"not a pickle")
    graph = precompiled.load_or_compile(FakeAot, lazy, (), path)
    assert graph() == "precompiled" and counts == {"compiled": 1}


def test_a_stale_file_is_compiled_again(tmp_path: Path, counts: Counter, monkeypatch) -> None:
    path = tmp_path / "extend.bin"
    path.write_bytes(b"old")
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f: FakeAot(accepts=False))
    graph = precompiled.load_or_compile(FakeAot, lazy, (), path)
    assert graph() == "precompiled" and counts == {"loaded": 1, "compiled": 1}


def test_a_failed_aot_compile_falls_back(tmp_path: Path, counts: Counter) -> None:
    def fail() -> None:
        raise RuntimeError("graph break")

    assert precompiled.load_or_compile(fail, lazy, (), tmp_path / "decode-1.bin") is None
    assert counts == {"fell_back": 1}
    assert "graph break" in (tmp_path / "decode-1.failed").read_text()
    # A later start goes straight to the fallback.
    assert precompiled.load_or_compile(FakeAot, lazy, (), tmp_path / "decode-1.bin") is None
    assert counts == {"fell_back": 2}


def test_inputs_the_guards_reject_run_the_lazy_graph(counts: Counter) -> None:
    graph = precompiled.Precompiled(FakeAot(accepts=False), lazy, "decode-2")
    assert graph() == "lazy" and graph() == "lazy"
    assert counts == {"guard_failed": 2, "guard_failed:decode-2": 2}


@dataclass
class Meta:
    table: torch.Tensor
    page_size: int


def test_a_static_graph_checks_guards_once_per_input_signature() -> None:
    """Decode buckets see the same shapes every step: their guards run once, not on every call;
    anything that changes what the guards see (a shape, a scalar, another object) checks them
    again."""
    aot, model = FakeAot(), object()
    graph = precompiled.Precompiled(aot, lazy, "decode-4", static=True)
    for _ in range(3):
        assert graph(model, torch.zeros(4, 2), Meta(torch.zeros(4, 8), 16)) == "precompiled"
    assert aot.checks == 1
    graph(model, torch.zeros(4, 3), Meta(torch.zeros(4, 8), 16))
    graph(model, torch.zeros(4, 3), Meta(torch.zeros(4, 8), 1))
    graph(object(), torch.zeros(4, 3), Meta(torch.zeros(4, 8), 1))
    graph(model, torch.zeros(4, 3, dtype=torch.int64), Meta(torch.zeros(4, 8), 1))
    assert aot.checks == 5


def test_a_dynamic_graph_checks_guards_on_every_call() -> None:
    aot = FakeAot()
    graph = precompiled.Precompiled(aot, lazy, "extend")
    for _ in range(3):
        graph(torch.zeros(4, 2))
    assert aot.checks == 3


def test_a_static_graph_whose_guards_reject_keeps_checking() -> None:
    aot = FakeAot(accepts=False)
    graph = precompiled.Precompiled(aot, lazy, "decode-1", static=True)
    assert graph(torch.zeros(1)) == "lazy" and graph(torch.zeros(1)) == "lazy"
    assert aot.checks == 2
