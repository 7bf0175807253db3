"""One cache entry on disk: a folder per key holding inductor's caches, the precompiled graphs and a
manifest that a complete warm-up writes last. The manifest lists every file with its size and hash,
so a truncated or garbled file (or a broken manifest) is caught before torch reads it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.runner.compile_cache.key import CacheKey

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass
class CacheEntry:
    root: Path
    digest: str

    @property
    def path(self) -> Path:
        return self.root / self.digest

    @property
    def inductor_dir(self) -> Path:
        return self.path / "inductor"

    @property
    def triton_dir(self) -> Path:
        return self.path / "triton"

    @property
    def precompiled_dir(self) -> Path:
        """Graphs saved by `torch.compile(...).aot_compile` (see
        `compiled_engine.runner.precompiled`)."""
        return self.path / "precompiled"

    @property
    def lock_path(self) -> Path:
        return self.root / ".locks" / f"{self.digest}.lock"

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across processes: one warm-up or start-up compiles into an entry at a time."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read_manifest(self) -> dict | None:
        try:
            return json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def problem(self) -> str | None:
        """Why this entry can't be trusted as a complete warm-up (None: it can)."""
        if not (self.path / MANIFEST).exists():
            return "no manifest (warm-up never finished)"
        manifest = self.read_manifest()
        if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
            return "unreadable manifest"
        if manifest.get("digest") != self.digest or not isinstance(manifest.get("files"), dict):
            return "manifest does not match its entry"
        for rel, expected in manifest["files"].items():
            path = self.path / rel
            if not path.is_file():
                return f"missing file {rel}"
            if [path.stat().st_size, _sha256(path)] != expected:
                return f"corrupted file {rel}"
        return None

    def write_manifest(self, key: CacheKey, compile_s: float) -> None:
        manifest = {
            "version": MANIFEST_VERSION,
            "digest": self.digest,
            "key": key.fields(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "compile_s": round(compile_s, 2),
            "files": {
                str(p.relative_to(self.path)): [p.stat().st_size, _sha256(p)] for p in self._files()
            },
        }
        tmp = self.path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.path / MANIFEST)

    def wipe(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def _files(self) -> list[Path]:
        return sorted(p for p in self.path.rglob("*") if p.is_file() and p.name != MANIFEST
                      and not p.name.startswith(f".{MANIFEST}"))


def list_entries(root: Path) -> list[CacheEntry]:
    if not root.is_dir():
        return []
    return [
        CacheEntry(root, p.name)
        for p in sorted(root.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    ]


def clear_entries(root: Path, prefix: str = "") -> list[CacheEntry]:
    """Remove every entry whose key digest starts with `prefix` (all when empty), each under its
    lock."""
    removed = [e for e in list_entries(root) if e.digest.startswith(prefix)]
    for entry in removed:
        with entry.locked():
            entry.wipe()
    return removed


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
