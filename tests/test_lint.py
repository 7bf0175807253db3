"""`ruff check .` is clean (pyproject.toml's rules, line length included): CI runs only `make test`,
so the lint runs here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
