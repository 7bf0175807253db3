"""The console script as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from compiled_engine.models.demo import demo_model_dir


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compiled_engine", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_model_prints_the_checkpoint_path() -> None:
    out = run_cli("demo-model")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(demo_model_dir())


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    out = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert out.returncode == 2
    assert "config.json" in out.stderr and "Traceback" not in out.stderr


def test_compile_mode_reaches_the_engine_config() -> None:
    import argparse

    from compiled_engine.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).compile_mode == "default"
    chosen = parser.parse_args(["--compile-mode", "max-autotune-freezing"])
    assert engine_config(chosen).compile_mode == "max-autotune-freezing"
