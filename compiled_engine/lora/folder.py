"""Adapter paths a client names, confined to the operator's folder (`--lora-dir`).

A path is taken relative to the folder (or as an absolute path inside it), normalised as text
first (so no `..` walks past a link outside the folder), then resolved with every symlink
followed: it is served only when that real path lies inside the folder's real path, and so do
the real paths of the files its reader opens (a PEFT folder's `PEFT_FILES`: a link among them to a
file outside is refused as the folder would be; links that stay inside, as the Hugging Face cache's
snapshots to its blobs, are served). Every path outside gets the same refusal (`OUTSIDE`, which
names no path), so that no answer tells whether something outside the folder exists, what it is,
or how large."""

from __future__ import annotations

import os

OUTSIDE = ("'lora_path' names no adapter this server loads at runtime: it reads adapters only "
           "from inside its --lora-dir folder")
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a PEFT reader opens


def confined(root: str, path: str) -> str | None:
    """The real path of `path` when it, and every file read for it, lies inside real folder `root`
    (`os.path.realpath` of the operator's folder); None when not or when it cannot be resolved."""
    try:
        spelled = os.path.normpath(os.path.join(root, path))
        if not _inside(root, spelled):
            return None
        real = os.path.realpath(spelled)
        read = [real, *(os.path.realpath(f) for f in _files_in(real))]
    except (OSError, ValueError):  # a NUL byte, an undecodable name, ...
        return None
    return real if all(_inside(root, p) for p in read) else None


def still_confined(root: str, real: str) -> bool:
    """Whether `real` (from `confined`) still resolves to itself inside `root`, the files read for
    it too: a link put in its way, or in place of one of its files, since is refused."""
    return confined(root, real) == real


def _files_in(real: str) -> list[str]:
    """The files the reader opens in folder `real` (a PEFT adapter's; a file is read itself)."""
    return [os.path.join(real, name) for name in PEFT_FILES] if os.path.isdir(real) else []


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root
