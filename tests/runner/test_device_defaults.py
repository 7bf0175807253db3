"""Deterministic mode's default per device: the README's table says what the code does, and this
machine's engine starts in the mode its row gives (saying so), unless told otherwise."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.models.demo import demo_model_dir
from compiled_engine.runner.device_defaults import DETERMINISTIC_BY_DEVICE, device_kind
from compiled_engine.startup import build_engine
from kernels import ops

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_table() -> dict[str, tuple[bool, bool]]:
    """device -> (on by default, on with speculation)."""
    text = README.read_text()
    table = text[
        text.index("<!-- deterministic-defaults") : text.index("<!-- end deterministic-defaults")
    ]
    rows = re.findall(r"^\| `([a-z0-9-]+)`[^|]*\| (on|off) \| (on|off) \|", table, re.MULTILINE)
    return {kind: (default == "on", spec == "on") for kind, default, spec in rows}


def test_the_readme_table_is_the_code_table() -> None:
    assert _readme_table() == {
        kind: (row.deterministic, row.deterministic or row.with_speculation)
        for kind, row in DETERMINISTIC_BY_DEVICE.items()
    }


def test_this_cpu_falls_in_the_row_of_what_its_native_kernels_run() -> None:
    kind = device_kind(torch.device("cpu"))
    native = ops.native_isa()
    if native is None or not ops.cpu_has_avx2():
        assert kind == "cpu-portable"
    elif ops.amx_available():
        assert kind == "cpu-amx"
    else:
        assert kind == ("cpu-avx512-bf16" if "avx512bf16" in native else "cpu-avx2")
    assert device_kind(torch.device("cuda", 0)) == "cuda"


def test_an_engine_starts_in_its_devices_mode_and_says_so(caplog) -> None:
    demo_dir = str(demo_model_dir())
    expected = DETERMINISTIC_BY_DEVICE[device_kind(torch.device("cpu"))].deterministic
    with caplog.at_level(logging.INFO, logger="compiled_engine.startup"):
        engine = build_engine(
            EngineConfig(model=demo_dir, enforce_eager=True, num_pages=64, max_running=2)
        )
    assert engine.runner.forward.deterministic is expected
    assert any(
        f"deterministic mode {'on' if expected else 'off'} by default on" in r.message
        for r in caplog.records
    )
    chosen = build_engine(
        EngineConfig(
            model=demo_dir,
            enforce_eager=True,
            num_pages=64,
            max_running=2,
            deterministic=not expected,
        )
    )
    assert chosen.runner.forward.deterministic is (not expected)
