"""Deterministic mode's default per device, chosen by measurement: on only where the A/B against
`--no-deterministic` showed a cost of at most 5% (README, "Deterministic inference", holds this
table for users; docs/benchmarks.md, the runs behind it). `--deterministic` / `--no-deterministic`
override it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops


@dataclass(frozen=True)
class DeviceDefault:
    deterministic: bool
    why: str
    # With speculation the mode is on where a fast batch-invariant path exists: a verify step
    # computes a request's 1 + k rows in one GEMM, plain decoding one row, and only batch-invariant
    # kernels give the two the same bits (a draft never changes a token).
    with_speculation: bool = True


DETERMINISTIC_BY_DEVICE: dict[str, DeviceDefault] = {
    "cpu-avx2": DeviceDefault(True, "measured faster than --no-deterministic (AMD Zen3)"),
    "cpu-avx512-bf16": DeviceDefault(
        True,
        "measured 0.97-1.07x --no-deterministic's offline throughput, prefill "
        "1.00-1.03x, batch-32 decode 1.14-1.24x (AMD Zen5)",
    ),
    "cpu-amx": DeviceDefault(False, "not measured on an AMX CPU yet"),
    "cpu-portable": DeviceDefault(
        False,
        "no native kernels (one row at a time) or no AVX2 (ARM: scalar C++ "
        "kernels): not measured, slow",
        with_speculation=False,
    ),
    "cuda": DeviceDefault(False, "not measured on a GPU yet"),
}


def device_kind(device: torch.device) -> str:
    """The row of DETERMINISTIC_BY_DEVICE a device falls in: what the native kernels run on a CPU
    (after COMPILED_ENGINE_CPU_ISA's cap)."""
    if device.type == "cuda":
        return "cuda"
    native = ops.native_isa()
    if native is None or not ops.cpu_has_avx2():
        return "cpu-portable"
    if ops.amx_available():
        return "cpu-amx"
    return "cpu-avx512-bf16" if "avx512bf16" in native else "cpu-avx2"


def deterministic_default(device: torch.device, speculative: bool = False) -> tuple[bool, str]:
    """(on or off, a one-line reason) for this device, with or without speculation."""
    kind = device_kind(device)
    row = DETERMINISTIC_BY_DEVICE[kind]
    why = (f"deterministic mode {'on' if row.deterministic else 'off'} by default on {kind}: "
           f"{row.why}")
    if not speculative or row.deterministic:
        return row.deterministic, why
    if row.with_speculation:
        return True, f"{why}; on with speculation, which is exact only with it"
    return False, (f"{why}; left off with speculation (one row at a time): drafts may change a "
                   "token at a near tie")
