"""`COMPILED_ENGINE_CPU_ISA` caps every ISA choice on the CPU: our native kernels' build, oneDNN,
ATen and inductor's vector ISA. Each level runs in a fresh process (the caps are read once per
process) that does what the engine builder does first: `kernels.init`."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kernels.cpu import isa as cpu_isa

PROBE = """
import json
import compiled_engine.llm, kernels, torch
from torch._inductor import cpu_vec_isa
from kernels import ops
kernels.init("cpu")
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(),
                  "inductor": str(cpu_vec_isa.pick_vec_isa()),
                  "native": sorted(ops.native_isa() or []), "amx": ops.amx_available()}))
"""


def probe(level: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env | {cpu_isa.ENV: level},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the levels are x86's")


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_each_level_reaches_what_the_plan_says(level: str) -> None:
    """This machine's real choices at each level are the plan's (tests/kernels/test_isa_plan.py
    checks the plan for every CPU family)."""
    got, want = probe(level), cpu_isa.here(level)
    if want.inductor_vec_isa is not None:
        assert got["inductor"] == want.inductor_vec_isa, (got, want)
    if want.aten_capability is not None:
        assert got["aten"] == want.aten_capability.upper(), (got, want)


def test_avx2_level_leaves_no_avx512_or_amx_anywhere() -> None:
    got = probe("avx2")
    assert got["aten"] in ("AVX2", "DEFAULT"), got
    assert "512" not in got["inductor"] and "amx" not in got["inductor"].lower(), got
    assert got["native"] == [] and not got["amx"], got


def test_avx512_level_leaves_no_amx() -> None:
    got = probe("avx512")
    assert got["aten"] in ("AVX512", "AVX2", "DEFAULT"), got
    assert "amx" not in got["inductor"].lower(), got
    assert "amx_bf16" not in got["native"] and not got["amx"], got


def test_native_level_is_at_least_as_capable() -> None:
    assert set(probe("avx2")["native"]) <= set(probe("native")["native"])


def test_an_unknown_level_is_a_clear_error() -> None:
    env = os.environ | {cpu_isa.ENV: "sse9"}
    message = "COMPILED_ENGINE_CPU_ISA='sse9': use one of native, avx512, avx2"
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; kernels.init('cpu')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and message in out.stderr
    cli = [sys.executable, "-m", "cli", "generate", "--prompt", "hi"]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    said = f"compiled-engine generate: error: {message}"
    assert out.returncode == 2 and out.stderr.strip() == said, out.stderr
