"""Results as plain data: JSON files, text tables, and a description of the machine."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path

_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cpu_flags": [f for f in _FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _clean(obj):
    """Plain JSON data; JSON has no inf/nan: write them as strings ('inf') and null."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _clean(dataclasses.asdict(obj))
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        return str(obj) if math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str, kind: str, result: object) -> None:
    doc = {"kind": kind, "command": sys.argv, "machine": machine(), "result": result}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean(doc), indent=2) + "\n")


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "-" if value is None else str(value)
