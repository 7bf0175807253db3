"""The GPU machine's scripts, as far as a CPU machine can run them: `gpu_check.sh` stops at once and
says why without a GPU, and every wheel `gpu_wheels.sh` fetches has a version to fetch it at."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_check_fails_fast_and_clearly_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


def test_every_gpu_wheel_has_a_version() -> None:
    script = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    names = re.search(r"names=\(([^)]*)\)", script).group(1).split()
    pins = {
        line.split("==")[0].lower()
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if "==" in line
    }
    assert "xgrammar" in names and "starlette" in names
    for name in names:
        if name.lower() not in pins:
            importlib.metadata.version(name)  # raises if neither pinned nor installed


def test_gpu_check_fails_a_step_whose_tests_all_skipped(tmp_path: Path) -> None:
    """On a GPU machine (here a stand-in interpreter that reports CUDA and whose pytest skips
    everything), a test step with no test passed is a failure, not 'ok'."""
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \" $* \" in *\" pytest \"*) echo '3 skipped in 0.01s';; esac\n"
                    "cat >/dev/null 2>&1 || true\nexit 0\n")
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake))
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in (tmp_path / "out" / "gpu_check.md").read_text().splitlines()
        if line.startswith("| ")
    }
    assert rows["kernels"] == rows["engine"] == "FAILED (no test passed: all skipped)", rows
    assert rows["latency"] == "ok"
