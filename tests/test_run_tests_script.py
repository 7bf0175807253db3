"""`make test` (scripts/run_tests.sh) runs every ISA-level rerun even when a run before it failed,
then
names the failed runs and exits with the first failure's status. Driven with a stand-in Python that
reports two levels below native and fails chosen runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
# -c: the levels below native; -m pytest: log the call, fail where a FAIL_WHEN pattern (;) matches
if [ "$1" = -c ]; then echo "avx512 avx2"; exit 0; fi
echo "pytest ${COMPILED_ENGINE_CPU_ISA:-native} $(printf '[%s]' "$@")" >>"$LOG"
IFS=';' read -r -a patterns <<<"$FAIL_WHEN"
for pattern in "${patterns[@]}"; do
  case "${COMPILED_ENGINE_CPU_ISA:-native} $*" in $pattern) exit 1;; esac
done
exit 0
"""


def _run(tmp_path: Path, fail_when: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    env = os.environ | {"PY": str(stub), "LOG": str(log), "FAIL_WHEN": fail_when,
                        "PYTEST_ARGS": '-x -m "not gpu"'}
    env.pop("COMPILED_ENGINE_CPU_ISA", None)
    done = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    return done, log.read_text().splitlines()


def test_a_failed_suite_still_runs_every_level_and_is_named(tmp_path: Path) -> None:
    done, calls = _run(tmp_path, "native*--durations*")
    assert done.returncode == 1
    assert [c.split()[1] for c in calls] == ["native", "avx512", "avx512", "avx2", "avx2"]
    assert all("[-x][-m][not gpu]" in c for c in calls)  # PYTEST_ARGS quoted as the shell does
    assert "[-k][not smollm2]" in calls[2] and "[-k][not (smollm2 and fast)]" in calls[4]
    assert done.stdout.strip().splitlines()[-1] == "== make test: failed runs: the suite (exit 1)"


def test_each_failed_run_is_named_and_a_green_run_says_so(tmp_path: Path) -> None:
    done, calls = _run(tmp_path, "avx512*test_kernels_invariant*;avx2*parity*")
    assert done.returncode == 1 and len(calls) == 5
    assert done.stdout.strip().splitlines()[-1] == \
        "== make test: failed runs: avx512 invariance (exit 1);avx2 parity (exit 1)"
    done, _ = _run(tmp_path, "nothing")
    assert done.returncode == 0
    assert done.stdout.strip().splitlines()[-1] == "== make test: every run passed"
