"""The parity tests' engine settings, fp32 bound, generation length and bf16 bound measurement."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.oracle import TOP, Bounds, hf_bf16_spread

FP32 = Bounds.exact(1e-4)
NEW_TOKENS = 12
ENGINE = dict(num_pages=2048, max_running=64, chunk_budget=256)


def bf16_bounds(path: str, prompts: list[list[int]], refs: list, device: str = "cpu") -> Bounds:
    spread = hf_bf16_spread(path, prompts, refs, top=TOP, device=device)
    print(f"transformers bf16 vs fp32 on {Path(path).name}: {spread}")
    return Bounds.bf16(spread)
