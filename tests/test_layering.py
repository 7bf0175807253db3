"""The layering of docs/architecture.md: the import-linter contracts of pyproject.toml (each layer
imports only the layers below it; the scheduler core is pure Python; kernels are reached through
`kernels.ops`), the scheduler's standard-library-only rule, no import circle between modules, and
no module importing another package's private names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "benchmarks", "server", "compiled_engine", "kernels")


def test_import_linter_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert lint is not None, "import-linter is part of the test requirements (requirements.txt)"
    out = subprocess.run(
        [lint, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_contracts_list_no_exceptions() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert "ignore_imports" not in text and "unmatched_ignore_imports_alerting" not in text


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every absolute import in `path`."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.module, alias.name) for alias in node.names)
    return found


def test_scheduler_imports_only_the_standard_library() -> None:
    bad = []
    for path in sorted((ROOT / "compiled_engine/scheduler").rglob("*.py")):
        for module, _ in _imports(path):
            top = module.split(".")[0]
            if top not in sys.stdlib_module_names and not module.startswith(
                "compiled_engine.scheduler"
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "compiled_engine.scheduler must stay stdlib-only:\n" + "\n".join(bad)


def test_importing_the_scheduler_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, pkgutil, importlib, compiled_engine.scheduler as s\nfor m in "
        "pkgutil.walk_packages(s.__path__, s.__name__ + '.'):\n    "
        "importlib.import_module(m.name)\nheavy = sorted(m for m in ('torch', 'numpy', 'triton', "
        "'kernels', 'server') if m in sys.modules)\nprint(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "", (
        f"importing compiled_engine.scheduler loaded: {out.stdout.strip()}"
    )


def _package_of(module: str) -> str:
    """The folder a module belongs to: `compiled_engine.runner.sampler` ->
    `compiled_engine.runner`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def test_no_module_imports_a_private_name_of_another_package() -> None:
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            here = _package_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
            for module, name in _imports(path):
                if module.split(".")[0] not in PACKAGES:
                    continue
                private = any(
                    part.startswith("_") and not part.startswith("__") for part in module.split(".")
                )
                private |= name is not None and name.startswith("_") and not name.startswith("__")
                if private and _package_of(module) != here:
                    bad.append(f"{path.relative_to(ROOT)}: from {module} import {name}")
    assert not bad, "private names stay inside their package:\n" + "\n".join(bad)


def _module_graph() -> dict[str, set[str]]:
    """Every module of PACKAGES -> the modules of PACKAGES it imports (type-checking imports too; a
    package's `__init__` re-exporting names is not an edge unless a submodule is named)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] != "__init__":
                modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for module, imported in _imports(path):
            for target in (f"{module}.{imported}", module):
                if target in modules and target != name:
                    edges.add(target)
                    break
    return graph


def test_no_import_circles() -> None:
    graph, index, low, stack, on_stack, circles = _module_graph(), {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in tests/helpers (or a conftest): importing a test module runs its
    module-level setup twice and hides its tests' dependencies."""
    bad = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "property_tests").rglob("*.py")]):
        for module, name in _imports(path):
            last = module.split(".")[-1]
            if last.startswith("test_") or (name or "").startswith("test_"):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_every_engine_module_has_a_layer() -> None:
    """A module in no layer is checked by no layers contract: its imports could point anywhere."""
    text = (ROOT / "pyproject.toml").read_text()
    layered = set()
    for line in text[text.index("layers = ["): text.index("]", text.index("layers = ["))].split(
        "\n"
    )[1:]:
        layered.update(name.strip().strip('",') for name in line.split("|"))
    engine = ROOT / "compiled_engine"
    modules = {
        f"compiled_engine.{p.stem if p.is_file() else p.name}"
        for p in engine.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert not modules - layered, f"in no layer of pyproject.toml: {sorted(modules - layered)}"
