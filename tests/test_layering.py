"""The layering in DESIGN.md: imports point down (server -> compiled_engine -> kernels) and the
scheduler core is pure standard library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def offenders(folder: str, allowed) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(m for m in imported_top_modules(path) if not allowed(m))
        if bad:
            found.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    return found


def test_scheduler_imports_only_the_standard_library() -> None:
    stdlib = sys.stdlib_module_names
    bad = offenders("compiled_engine/scheduler", lambda m: m in stdlib or m == "compiled_engine")
    assert not bad, "compiled_engine.scheduler must stay stdlib-only:\n" + "\n".join(bad)


def test_scheduler_relative_imports_stay_inside_the_package() -> None:
    for path in sorted((ROOT / "compiled_engine/scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("compiled_engine."):
                assert module.startswith("compiled_engine.scheduler"), f"{path}: imports {module}"


def test_importing_the_scheduler_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, pkgutil, importlib, compiled_engine.scheduler as s\n"
        "for m in pkgutil.walk_packages(s.__path__, s.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'triton', 'kernels', 'server') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"importing compiled_engine.scheduler loaded: {out.stdout.strip()}"


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("kernels", {"compiled_engine", "server"}), ("compiled_engine", {"server"})],
)
def test_imports_point_down(folder: str, forbidden: set[str]) -> None:
    bad = offenders(folder, lambda m: m not in forbidden)
    assert not bad, "imports must point down (server -> compiled_engine -> kernels):\n" + "\n".join(bad)
