"""CPU engines keep freed host memory: a prefill-like chain of large tensors then reuses pages
instead of page-faulting (and zeroing) fresh ones on every step."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STEP_FAULTS = """
import sys
import torch
from compiled_engine import host_malloc

if sys.argv[1] == "keep" and not host_malloc.keep_freed_memory():
    print("unsupported")
    raise SystemExit
x = torch.randn(4096, 768)

def minor_faults() -> int:
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

# ~12-48 MB intermediates, each freed once the next exists (no BLAS call: some BLAS libraries map
# scratch of their own per call, which no malloc setting keeps)
def step() -> None:
    h = x
    for n in (4, 1, 2, 1):
        h = torch.cat([h[:, :768]] * n, dim=1).relu_()

# glibc's heap settles over the first few steps (small allocations land between big ones)
for _ in range(6):
    step()
before = minor_faults()
for _ in range(3):
    step()
print((minor_faults() - before) // 3)
"""


def _faults_per_step(mode: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", STEP_FAULTS, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return run.stdout.strip()


@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="needs Linux's per-process fault counters"
)
def test_kept_memory_avoids_most_page_faults_of_a_repeated_step() -> None:
    kept = _faults_per_step("keep")
    if kept == "unsupported":
        pytest.skip("malloc is not glibc's")
    default = int(_faults_per_step("default"))
    # by default each step faults in tens of MB of fresh pages (48 MB mmapped anew)
    assert default > 5_000
    assert int(kept) < default / 10


def test_build_engine_keeps_freed_memory_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from compiled_engine import LLM, startup

    calls = []
    monkeypatch.setattr(startup, "keep_freed_memory", lambda: calls.append(True) or True)
    LLM("demo", enforce_eager=True, num_pages=64).engine.shutdown()
    assert calls == [True]
