"""The GPU machine's scripts, as far as a CPU machine can run them: `gpu_check.sh` stops at once and says
why without a GPU, and every wheel `gpu_wheels.sh` fetches has a version to fetch it at."""

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
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


def test_every_gpu_wheel_has_a_version() -> None:
    script = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    names = re.search(r"names=\(([^)]*)\)", script).group(1).split()
    pins = {line.split("==")[0].lower() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line}
    assert "xgrammar" in names and "starlette" in names
    for name in names:
        if name.lower() not in pins:
            importlib.metadata.version(name)  # raises if neither pinned nor installed
