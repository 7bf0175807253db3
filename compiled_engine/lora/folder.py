"""Adapter paths a client names, confined to the operator's folder (`--lora-dir`).

A path is taken relative to the folder (or as an absolute path inside it), normalised as text
first (so no `..` walks past a link outside the folder), then resolved with every symlink
followed: it is served only when that real path lies inside the folder's real path. Every path
outside gets the same refusal (`OUTSIDE`, which names no path), so that no answer tells whether
something outside the folder exists, what it is, or how large."""

from __future__ import annotations

import os

OUTSIDE = ("'lora_path' names no adapter this server loads at runtime: it reads adapters only "
           "from inside its --lora-dir folder")


def confined(root: str, path: str) -> str | None:
    """The real path of `path` when it lies inside real folder `root` (`os.path.realpath` of the
    operator's folder); None when it does not or cannot be resolved."""
    try:
        spelled = os.path.normpath(os.path.join(root, path))
        if not _inside(root, spelled):
            return None
        real = os.path.realpath(spelled)
    except (OSError, ValueError):  # a NUL byte, an undecodable name, ...
        return None
    return real if _inside(root, real) else None


def still_confined(root: str, real: str) -> bool:
    """Whether `real` (from `confined`) still resolves to itself inside `root`: a link put in
    its way since is refused."""
    return confined(root, real) == real


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root
