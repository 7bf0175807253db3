"""KV pages on local disk, one file per page, named by the page's key.

A file is a header (magic, the key, the payload's length and CRC-32) and the payload. Writes go to
a temporary file renamed into place, so a reader sees a whole page or none; a file that does not
check out (torn, corrupt, another key) is deleted and read as a miss. The index of what is stored
is rebuilt from the directory when the store opens (by modification time: the least recently used
go first when the store is over its byte budget), on a thread: opening waits for it at most
`REBUILD_WAIT_S`, and a page not indexed yet is a miss. One process owns a directory: an advisory
lock (`flock`) refuses a second one.

Only this user reads the pages: folders are 0700 and files 0600 whatever the umask, and a folder
owned by another user is refused (`UnsafeFolder`). Stores of other keys that share the budget
(`stale`: another model or layout under the same --kv-cache-dir, `folder.open_store`) count
against it and are removed whole, least recently used first, before any page of this one."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from compiled_engine.private_dir import ensure_private_dir, lock_folder, open_private

MAGIC = b"CEKVPG1\n"
HEADER = struct.Struct("<8s32sQI")  # magic, key, payload bytes, crc32 of the payload
SUFFIX = ".kv"
REBUILD_WAIT_S = 2.0  # a bigger store is indexed on after the store opens


def lock_store_folder(folder: Path) -> IO:
    """The lock on a KV tier folder (`private_dir.lock_folder`); FolderBusy when another process
    holds it."""
    return lock_folder(folder, f"another process uses the KV tier directory {folder} (give each "
                               "server its own --kv-cache-dir)")


class PageStore:
    def __init__(self, root: str | Path, budget_bytes: int,
                 rebuild_wait_s: float = REBUILD_WAIT_S, stale: Sequence[Path] = (),
                 held: IO | None = None) -> None:
        """`stale`: other stores whose bytes count against `budget_bytes` (removed first);
        `held`: a lock file this store closes with its own."""
        self.root = ensure_private_dir(root)
        self.budget_bytes = budget_bytes
        for sub in self.root.iterdir():
            if sub.is_dir():
                ensure_private_dir(sub, warn=False)  # the store's own folder said it
        self._lock_file = lock_store_folder(self.root)
        self._held = held
        self._mutex = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, oldest first
        self.bytes = 0
        self.num_corrupt = 0  # files that did not check out (deleted)
        self.track_removed = False  # keep the keys of removed pages for `take_removed`
        self._removed: list[bytes] = []
        self._gone: set[bytes] | None = set()  # while the index is rebuilt: files removed since
        self._stale_dirs = list(stale)
        self._stale: list[tuple[int, Path, int]] = []  # (last use in ns, store, bytes), oldest last
        self.stale_bytes = 0
        self._rebuilt = threading.Thread(target=self._rebuild, name="kv-tier-index", daemon=True)
        self._rebuilt.start()
        self._rebuilt.join(rebuild_wait_s)

    # ---- reading and writing ------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        with self._mutex:
            return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store `payload` as `key` (already there: only its use is noted); False when it is larger
        than the whole budget."""
        size = HEADER.size + len(payload)
        if size > self.budget_bytes:
            return False
        with self._mutex:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        path = self._path(key)
        if not path.parent.is_dir():
            ensure_private_dir(path.parent)
        tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            with open_private(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk leaves no partial file
            raise
        with self._mutex:
            if key not in self._index:
                self._index[key] = size
                self.bytes += size
            doomed = self._evict_over_budget()
        _remove_stores(doomed)
        return True

    def touch(self, keys) -> None:
        """Make the stored ones of `keys` the most recently used (in memory: a restart orders
        pages by their files' times)."""
        with self._mutex:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)

    def get(self, key: bytes) -> bytes | None:
        """The payload stored as `key`, None when absent or when its file does not check out (the
        file is then removed)."""
        with self._mutex:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile
            return None
        except OSError:
            data = b""
        payload = _check(data, key)
        if payload is None:
            self.num_corrupt += 1
            self._drop(key)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its use, for the order of eviction after a restart
        return payload

    def take_removed(self) -> list[bytes]:
        """The keys of the pages removed (evicted, or corrupt) since the last call (with
        `track_removed`)."""
        with self._mutex:
            removed, self._removed = self._removed, []
        return removed

    def close(self) -> None:
        self._rebuilt.join()
        self._lock_file.close()
        if self._held is not None:
            self._held.close()

    # ---- inspection ---------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the index matches the directory and the budget holds."""
        self._rebuilt.join()
        with self._mutex:
            on_disk = {p.stem: p.stat().st_size for p in self.root.glob(f"*/*{SUFFIX}")}
            indexed = {k.hex(): size for k, size in self._index.items()}
            assert on_disk == indexed, f"index {sorted(indexed)} != files {sorted(on_disk)}"
            assert self.bytes == sum(indexed.values()), "byte count off"
            total = self.bytes + self.stale_bytes
            assert total <= self.budget_bytes, f"{total} bytes over {self.budget_bytes}"
            assert not list(self.root.glob("*/*.tmp")), "a temporary file was left behind"

    # ---- internals ----------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    def _drop(self, key: bytes) -> None:
        with self._mutex:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes -= size
            if self._gone is not None:
                self._gone.add(key)
            if self.track_removed and size is not None:
                self._removed.append(key)
        self._path(key).unlink(missing_ok=True)

    def _evict_over_budget(self) -> list[Path]:
        """Under the mutex: forget the least recently used stale stores, then remove the least
        recently used pages, until within the budget; returns the stores to remove (outside the
        mutex: a store is many files)."""
        doomed = []
        while self.bytes + self.stale_bytes > self.budget_bytes and self._stale:
            _, store, size = self._stale.pop()
            self.stale_bytes -= size
            doomed.append(store)
        while self.bytes > self.budget_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.bytes -= size
            if self._gone is not None:
                self._gone.add(key)
            if self.track_removed:
                self._removed.append(key)
            self._path(key).unlink(missing_ok=True)
        return doomed

    def _rebuild(self) -> None:
        """Index the directory's pages (older than any stored since it opened), making any file
        that others may read 0600; remove temporary files that a process which stopped mid-write
        left; skip names that are not keys. Then measure the stale stores."""
        mine = f".{os.getpid()}-"
        found: list[tuple[int, bytes, int]] = []
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in sub.iterdir():
                if path.suffix == ".tmp":
                    if mine not in path.name:
                        path.unlink(missing_ok=True)
                    continue
                try:
                    key = bytes.fromhex(path.stem)
                    info = path.lstat()
                except (ValueError, OSError):
                    continue
                if path.suffix == SUFFIX and len(key) == 32 and stat.S_ISREG(info.st_mode):
                    if info.st_mode & 0o077:
                        with contextlib.suppress(OSError):
                            os.chmod(path, 0o600)
                    found.append((info.st_mtime_ns, key, info.st_size))
        found.sort(reverse=True)
        stale = sorted((_measure(store) for store in self._stale_dirs), reverse=True)
        with self._mutex:
            removed, self._gone = self._gone, None
            for _, key, size in found:  # newest first, each before the ones indexed so far
                # (one stored since it opened stays the newest; one removed since stays out)
                if key not in self._index and key not in removed:
                    self._index[key] = size
                    self.bytes += size
                    self._index.move_to_end(key, last=False)
            self._stale = stale  # the least recently used last
            self.stale_bytes = sum(size for _, _, size in self._stale)
            doomed = self._evict_over_budget()
        _remove_stores(doomed)


def _measure(store: Path) -> tuple[int, Path, int]:
    """A store's last use (its newest file's modification time, in ns), path and bytes."""
    used = size = 0
    for where, _, files in os.walk(store):
        for name in files:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(where, name))
                used, size = max(used, info.st_mtime_ns), size + info.st_size
    return used, store, size


def _remove_stores(stores: Sequence[Path]) -> None:
    for store in stores:
        shutil.rmtree(store, ignore_errors=True)


def _check(data: bytes, key: bytes) -> bytes | None:
    """The payload of a page file's bytes if they check out as `key`'s."""
    if len(data) < HEADER.size:
        return None
    magic, stored_key, length, crc = HEADER.unpack_from(data)
    payload = data[HEADER.size :]
    if magic != MAGIC or stored_key != key or length != len(payload) or zlib.crc32(payload) != crc:
        return None
    return payload
