"""Importing the kernels does nothing but define the ops: no environment variable set, no native
library built or loaded; `kernels.init` does both."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.cpu import isa as cpu_isa

ROOT = Path(__file__).resolve().parents[2]
CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

PROBE = f"""
import json, os, sys
import torch
environ = dict(os.environ)
import kernels, kernels.ops as ops
from kernels.cpu import build
changed = sorted(k for k in set(environ) | set(os.environ) if environ.get(k) != os.environ.get(k))
before = {{v: os.environ.get(v) for v in {CAPS!r}}}
loaded = build.load.cache_info().currsize
native = ops.load_cpu_kernels.cache_info().currsize
def registered():  # the native library registers the CPU kernels when it loads
    return torch._C._dispatch_has_kernel_for_dispatch_key("kernels::decode_attention", "CPU")
registered_at_import = registered()
ready = kernels.init("cpu") if sys.argv[1] == "init" else None
after = {{v: os.environ.get(v) for v in {CAPS!r}}}
print(json.dumps(dict(changed=changed, before=before, loaded=loaded, native=native, ready=ready,
                      after=after, registered_at_import=registered_at_import,
                      registered=registered())))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    env["COMPILED_ENGINE_CPU_ISA"] = "avx2"  # a level with caps to set
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_kernels_sets_nothing_and_builds_nothing() -> None:
    seen = _probe("import")
    assert seen["changed"] == []  # importing the kernels changed no environment variable
    assert seen["before"] == {v: None for v in CAPS}
    assert seen["loaded"] == 0 and seen["native"] == 0
    assert not seen["registered_at_import"] and not seen["registered"]
    assert seen["after"] == {v: None for v in CAPS}


def test_init_applies_the_isa_caps_and_loads_the_native_kernels() -> None:
    seen = _probe("init")
    assert seen["before"] == {v: None for v in CAPS}
    assert seen["after"] == {v: cpu_isa.env_caps("avx2").get(v) for v in CAPS}  # none off x86
    from kernels import ops

    # the native library serves the CPU wherever it builds here
    assert seen["ready"] == ops.load_cpu_kernels()
    assert not seen["registered_at_import"] and seen["registered"] == seen["ready"]
