"""Graphs compiled ahead of time (`torch.compile(...).aot_compile`) and saved to a file, so that a
warm start loads them without tracing with dynamo. The saved guards are checked on every call (a
static graph: once per input signature); whatever fails (compiling, saving, loading, a guard) falls
back to the lazily compiled graph and is logged."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

log = logging.getLogger(__name__)

# Graphs this process "loaded" from files, "compiled" ahead of time (and saved), or "fell back" to
# torch.compile for (failed to precompile or load); "guard_failed": calls that a precompiled graph's
# guards sent to the fallback.
counts: Counter[str] = Counter()


class Precompiled:
    """A precompiled graph behind its guards, with the lazily compiled graph for inputs they reject.

    The guards check every weight and cache tensor of the model: a noticeable part of a small
    model's decode step (docs/benchmarks.md). A `static` graph (fixed shapes: a decode bucket)
    therefore checks them once per input signature (`input_signature`: the same objects and tensor
    layouts pass the same guards)."""

    def __init__(self, aot: AOTCompiledFunction, fallback: Callable[..., torch.Tensor], name: str,
                 static: bool = False) -> None:
        self.aot, self.fallback, self.name, self.static = aot, fallback, name, static
        self._passed: tuple | None = None  # the input signature whose guards passed (static graphs)
        aot.disable_guard_check()  # checked here instead, to fall back rather than raise

    def __call__(self, *args) -> torch.Tensor:
        signature = input_signature(args) if self.static else None
        if signature is not None and signature == self._passed:
            return self.aot(*args)
        if self.aot.guard_check(*args):
            self._passed = signature
            return self.aot(*args)
        if not counts[f"guard_failed:{self.name}"]:
            log.warning(
                "precompiled graph %s: guards reject these inputs; compiling with dynamo", self.name
            )
        counts["guard_failed"] += 1
        counts[f"guard_failed:{self.name}"] += 1
        return self.fallback(*args)


def input_signature(args: tuple) -> tuple:
    """What guards can tell apart in `args`, cheaply: each tensor's dtype, device, shape and
    strides, and the value of a plain scalar and the identity of any other object (the model, whose
    weights do not change while it serves); the fields of a dataclass argument (the attention
    metadata) one by one."""
    leaves: list[object] = []
    for arg in args:
        leaves.extend(vars(arg).values() if dataclasses.is_dataclass(arg) else (arg,))
    return tuple(
        (v.dtype, v.device, v.shape, v.stride()) if isinstance(v, torch.Tensor)
        else (type(v), v if isinstance(v, int | float | str | None) else id(v))
        for v in leaves
    )


def load_or_compile(
    aot_compile: Callable[[], AOTCompiledFunction],
    fallback: Callable[..., torch.Tensor],
    args: tuple,
    path: Path,
    static: bool = False,
) -> Precompiled | None:
    """The graph saved at `path` if it loads and accepts `args`, else the one `aot_compile()`
    returns (a `torch.compile(..., fullgraph=True)(...).aot_compile(...)` for `args`), saved there;
    None if that fails, now or in an earlier start (a `.failed` file next to `path` says why, so
    warm starts do not retry)."""
    name, failed = path.stem, path.with_suffix(".failed")
    if failed.is_file():
        counts["fell_back"] += 1
        return None
    aot = _load(path) if path.is_file() else None
    if aot is not None and not aot.guard_check(*args):
        log.warning(
            "precompiled graph %s: stale (guards reject the warm-up inputs); compiling it again",
            name,
        )
        aot = None
    if aot is None:
        aot = _compile(aot_compile, path)
    if aot is None:
        counts["fell_back"] += 1
        return None
    return Precompiled(aot, fallback, name, static)


def _load(path: Path) -> AOTCompiledFunction | None:
    try:
        with open(path, "rb") as f:
            aot = torch.compiler.load_compiled_function(f)
    except Exception as e:  # noqa: BLE001 - any failure to load means: compile instead
        log.warning(
            "precompiled graph %s: cannot load (%s: %s); compiling it again",
            path.stem,
            type(e).__name__,
            e,
        )
        return None
    counts["loaded"] += 1
    return aot


def _compile(
    aot_compile: Callable[[], AOTCompiledFunction], path: Path
) -> AOTCompiledFunction | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        aot = aot_compile()
    except Exception as e:  # noqa: BLE001 - torch.compile's lazy path still works without it
        log.warning(
            "precompiled graph %s: aot_compile failed (%s: %s); falling back to torch.compile",
            path.stem,
            type(e).__name__,
            e,
        )
        path.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        return None
    counts["compiled"] += 1
    try:
        aot.save_compiled_function(str(path))
    except Exception as e:  # noqa: BLE001 - usable in this process all the same
        log.warning("precompiled graph %s: cannot save (%s: %s)", path.stem, type(e).__name__, e)
    return aot
