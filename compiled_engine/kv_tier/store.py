"""KV pages on local disk, one file per page, named by the page's key.

A file is a header (magic, the key, the payload's length and CRC-32) and the payload. Writes go to
a temporary file renamed into place, so a reader sees a whole page or none; a file that does not
check out (torn, corrupt, another key) is deleted and read as a miss. The index of what is stored
is rebuilt from the directory when the store opens (by modification time: the least recently used
go first when the store is over its byte budget), on a thread: opening waits for it at most
`REBUILD_WAIT_S`, and a page not indexed yet is a miss. One process owns a directory: an advisory
lock (`flock`) refuses a second one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

MAGIC = b"CEKVPG1\n"
HEADER = struct.Struct("<8s32sQI")  # magic, key, payload bytes, crc32 of the payload
SUFFIX = ".kv"
REBUILD_WAIT_S = 2.0  # a bigger store is indexed on after the store opens


class StoreBusy(RuntimeError):
    """Another process holds the store's directory."""


class PageStore:
    def __init__(self, root: str | Path, budget_bytes: int,
                 rebuild_wait_s: float = REBUILD_WAIT_S) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "a+")  # noqa: SIM115 - held while open
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreBusy(f"another process uses the KV tier directory {self.root} (give each "
                            "server its own --kv-cache-dir)") from None
        self._mutex = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, oldest first
        self.bytes = 0
        self.num_corrupt = 0  # files that did not check out (deleted)
        self.track_removed = False  # keep the keys of removed pages for `take_removed`
        self._removed: list[bytes] = []
        self._gone: set[bytes] | None = set()  # while the index is rebuilt: files removed since
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
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
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
            self._evict_over_budget()
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

    # ---- inspection ---------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the index matches the directory and the budget holds."""
        self._rebuilt.join()
        with self._mutex:
            on_disk = {p.stem: p.stat().st_size for p in self.root.glob(f"*/*{SUFFIX}")}
            indexed = {k.hex(): size for k, size in self._index.items()}
            assert on_disk == indexed, f"index {sorted(indexed)} != files {sorted(on_disk)}"
            assert self.bytes == sum(indexed.values()), "byte count off"
            assert self.bytes <= self.budget_bytes, f"{self.bytes} bytes over {self.budget_bytes}"
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

    def _evict_over_budget(self) -> None:
        """Under the mutex: remove the least recently used pages until within the budget."""
        while self.bytes > self.budget_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.bytes -= size
            if self._gone is not None:
                self._gone.add(key)
            if self.track_removed:
                self._removed.append(key)
            self._path(key).unlink(missing_ok=True)

    def _rebuild(self) -> None:
        """Index the directory's pages (older than any stored since it opened); remove temporary
        files that a process which stopped mid-write left; skip names that are not keys."""
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
                    stat = path.stat()
                except (ValueError, OSError):
                    continue
                if path.suffix == SUFFIX and len(key) == 32:
                    found.append((stat.st_mtime_ns, key, stat.st_size))
        found.sort(reverse=True)
        with self._mutex:
            removed, self._gone = self._gone, None
            for _, key, size in found:  # newest first, each before the ones indexed so far
                # (one stored since it opened stays the newest; one removed since stays out)
                if key not in self._index and key not in removed:
                    self._index[key] = size
                    self.bytes += size
                    self._index.move_to_end(key, last=False)
            self._evict_over_budget()


def _check(data: bytes, key: bytes) -> bytes | None:
    """The payload of a page file's bytes if they check out as `key`'s."""
    if len(data) < HEADER.size:
        return None
    magic, stored_key, length, crc = HEADER.unpack_from(data)
    payload = data[HEADER.size :]
    if magic != MAGIC or stored_key != key or length != len(payload) or zlib.crc32(payload) != crc:
        return None
    return payload
