"""The Batch API's state on disk (`--batch-dir`): files (`files/<id>.jsonl` and their object,
`<id>.json`) and batches (`batches/<id>.json`, and the lines answered so far,
`<id>.output.jsonl` / `<id>.errors.jsonl`, appended as they come). Objects are written whole
(a temporary file, then a rename), so a restart finds each as it last was; one that cannot be read
(cut short by a power loss, say) is left out, with one log line. Each object belongs to the API
key that made it (its `owner`, a hash of the key): another key finds no such object. Folders are
0700 and files 0600. Every byte written counts against one disk budget: what a client asks for (an
upload, a new batch, a batch's answers) is refused past it; what finishes a batch already taken (its
status and counts, its answer files' objects: a few KiB a batch) is written even past it. An owner
has at most `MAX_UNFINISHED` batches not yet finished. Blocking file work: callers run it off the
event loop."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from compiled_engine.private_dir import ensure_private_dir, lock_folder, open_private
from server.request_errors import ProtocolError

log = logging.getLogger(__name__)
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
NO_OWNER = ""  # the owner of everything when the server has no API key
MAX_UNFINISHED = 64  # an owner's batches not yet finished (ACTIVE)
PART, TEMP = ".part", ".tmp"  # an upload, an object, while being written
IDS = {"file": re.compile(r"file-[0-9a-f]{32}"), "batch": re.compile(r"batch_[0-9a-f]{32}")}
# what an object of each kind must hold (key: type) to be read as one
SHAPES = {"file": {"id": str, "created_at": int, "bytes": int, "purpose": str, "filename": str},
          "batch": {"id": str, "created_at": int, "status": str, "endpoint": str,
                    "input_file_id": str, "expires_at": int, "request_counts": dict}}


def owner_of(api_key: str | None) -> str:
    """The owner an API key stands for: its SHA-256 (the key itself is never kept)."""
    return NO_OWNER if not api_key else hashlib.sha256(api_key.encode()).hexdigest()


def public(obj: dict) -> dict:
    """An object as clients see it (OpenAI's fields, without its owner)."""
    return {k: v for k, v in obj.items() if k != "owner"}


def state_root() -> Path:
    """The default `--batch-dir`: `$XDG_STATE_HOME/compiled-engine/batches`, else
    `~/.local/state/compiled-engine/batches`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "compiled-engine" / "batches"


class BatchStore:
    def __init__(self, root: Path, disk_budget: int = 10 << 30) -> None:
        """`disk_budget`: the bytes all files and answers may take together. UnsafeFolder (an
        OSError) for a folder of another user's or one others may write; FolderBusy (an OSError)
        while another process's store holds it (until `close`)."""
        ensure_private_dir(root)
        self._held = lock_folder(root, f"another server uses the Batch API's folder {root} (give "
                                       "each server its own --batch-dir)")
        self.files = ensure_private_dir(root / "files")
        self.batches = ensure_private_dir(root / "batches")
        self.disk_budget = disk_budget
        self._lock = threading.Lock()  # writers on several threads; `used`
        self._reported: set[str] = set()  # unreadable objects already logged
        self.used = self._tighten()

    def close(self) -> None:
        """Let another store open the folder."""
        self._held.close()

    def _tighten(self) -> int:
        """The bytes kept; every file made 0600 (a store an older server wrote kept the umask);
        the temporary files a stop left (an upload or an object being written) removed: the
        store holds the folder, so no one writes them now."""
        used = 0
        for folder in (self.files, self.batches):
            for entry in os.scandir(folder):
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.endswith((PART, TEMP)):
                    os.unlink(entry.path)
                    continue
                os.chmod(entry.path, 0o600)
                used += entry.stat().st_size
        return used

    def _count(self, size: int) -> None:
        with self._lock:
            self.used += size

    # ---- files ----------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files / f"{_checked_id(file_id, 'file')}.jsonl"

    def add_upload(self, source: BinaryIO, filename: str, owner: str, max_bytes: int) -> dict:
        """`source` read into a new file of `owner`'s (purpose "batch"); 413 past `max_bytes`
        or past the disk budget, nothing kept."""
        file_id = f"file-{uuid.uuid4().hex}"
        path = self.file_path(file_id)
        part, size = path.with_suffix(PART), 0
        try:
            with open_private(part, "wb") as out:
                while chunk := source.read(1 << 20):
                    if size + len(chunk) > max_bytes:
                        raise ProtocolError(f"the file is larger than {max_bytes} bytes "
                                            "(--max-batch-file-mb)", "file", status=413)
                    with self._lock:
                        if self.used + len(chunk) > self.disk_budget:
                            raise _store_full(self.disk_budget)
                        self.used += len(chunk)
                    size += len(chunk)
                    out.write(chunk)
            os.replace(part, path)
            return self._describe(file_id, filename, "batch", owner, within_budget=True)
        except BaseException:
            part.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            self._count(-size)
            raise

    def _describe(self, file_id: str, filename: str, purpose: str, owner: str,
                  within_budget: bool = False) -> dict:
        """Write the object of the file kept as `file_id`; the object."""
        obj = {"id": file_id, "object": "file", "bytes": self.file_path(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None,
               "owner": owner}
        with self._lock:
            self._write(self.files / f"{file_id}.json", obj, within_budget)
        return obj

    def file(self, file_id: str, owner: str | None, param: str = "file_id") -> dict:
        """A file's object (`owner` None: whoever owns it); 404 (naming `param`) without it."""
        obj = self._object("file", self.files, file_id, param)
        if obj is None or (owner is not None and obj.get("owner", NO_OWNER) != owner):
            raise ProtocolError(f"No such File object: {file_id[:80]}", param, status=404,
                                code="not_found")
        return obj

    def open_content(self, file_id: str, owner: str) -> BinaryIO:
        """`owner`'s file's content, open (a delete from now on leaves it readable to the end);
        404 without it, as for one deleted since its object was read."""
        self.file(file_id, owner)
        try:
            return open(self.file_path(file_id), "rb")  # the caller closes it
        except FileNotFoundError:
            raise ProtocolError(f"No such File object: {file_id[:80]}", "file_id", status=404,
                                code="not_found") from None

    def list_files(self, purpose: str | None, owner: str) -> list[dict]:
        objs = [o for o in self._objects("file", self.files)
                if o.get("owner", NO_OWNER) == owner and purpose in (None, o["purpose"])]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete_file(self, file_id: str, owner: str) -> None:
        self.file(file_id, owner)
        for path in (self.file_path(file_id), self.files / f"{file_id}.json"):
            self._count(-_unlink(path))

    # ---- batches --------------------------------------------------------------------------------
    def new_batch(self, obj: dict, owner: str) -> dict:
        """A new batch of `owner`'s: 429 while it has `MAX_UNFINISHED` batches not yet finished,
        413 past the disk budget."""
        obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", **obj, "owner": owner}
        with self._lock:
            unfinished = sum(1 for o in self._objects("batch", self.batches)
                             if o.get("owner", NO_OWNER) == owner and o["status"] in ACTIVE)
            if unfinished >= MAX_UNFINISHED:
                raise ProtocolError(f"at most {MAX_UNFINISHED} of your batches may be unfinished "
                                    "at once: wait for one to end, or cancel one", None,
                                    status=429, kind="rate_limit_error",
                                    code="too_many_unfinished_batches")
            self._write(self.batches / f"{obj['id']}.json", obj, within_budget=True)
        return obj

    def put_batch(self, obj: dict) -> None:
        """A batch's object saved as it is now (written even past the disk budget: a batch
        already taken must be able to finish)."""
        with self._lock:
            self._write(self.batches / f"{obj['id']}.json", obj, within_budget=False)

    def batch(self, batch_id: str, owner: str | None) -> dict:
        """A batch's object (`owner` None: whoever owns it); 404 without it."""
        obj = self._object("batch", self.batches, batch_id, "batch_id")
        if obj is None or (owner is not None and obj.get("owner", NO_OWNER) != owner):
            raise ProtocolError(f"No such Batch object: {batch_id[:80]}", "batch_id", status=404,
                                code="not_found")
        return obj

    def list_batches(self, owner: str | None) -> list[dict]:
        """`owner`'s batches, newest first (None: everyone's)."""
        objs = [o for o in self._objects("batch", self.batches)
                if owner is None or o.get("owner", NO_OWNER) == owner]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def answers_path(self, batch_id: str, kind: str) -> Path:
        """Where a batch's answered lines go as they come: kind "output" or "errors"."""
        return self.batches / f"{_checked_id(batch_id, 'batch')}.{kind}.jsonl"

    def answers_bytes(self, batch_id: str) -> int:
        """The bytes a batch has answered so far (both kinds)."""
        paths = (self.answers_path(batch_id, kind) for kind in ("output", "errors"))
        return sum(p.stat().st_size for p in paths if p.is_file())

    def answered(self, batch_id: str) -> dict[str, set[str]]:
        """The custom ids a batch has answered, by kind ("output", "errors"): a restart goes on
        from there. Read a line at a time; the file is cut at its first line that is not whole
        (the process, or the machine, stopped while writing it): that line and any after it run
        again."""
        done: dict[str, set[str]] = {}
        for kind in ("output", "errors"):
            path = self.answers_path(batch_id, kind)
            ids, end = set(), 0
            if path.is_file():
                with open(path, "rb") as f:
                    for line in f:
                        try:
                            ids.add(json.loads(line)["custom_id"])
                        except (ValueError, KeyError, TypeError):
                            break
                        if not line.endswith(b"\n"):
                            break
                        end += len(line)
                size = path.stat().st_size
                if end != size:
                    os.truncate(path, end)
                    self._count(end - size)
            done[kind] = ids
        return done

    def append_answer(self, batch_id: str, kind: str, line: bytes) -> bool:
        """One answered line (JSON, no newline), written to the file before this returns (in the
        OS's cache: a machine that stops may lose the last ones, which then run again); False,
        nothing written, when it does not fit in the disk budget."""
        with self._lock:
            if self.used + len(line) + 1 > self.disk_budget:
                return False
            with open_private(self.answers_path(batch_id, kind), "ab") as f:
                f.write(line + b"\n")
            self.used += len(line) + 1
        return True

    def keep_answers(self, batch_id: str, kind: str, file_id: str, owner: str) -> str | None:
        """A batch's answered lines of `kind` as `owner`'s file `file_id` (None when there are
        none); again after a restart, it finishes a move it began."""
        path, target = self.answers_path(batch_id, kind), self.file_path(file_id)
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
        if path.is_file():
            os.replace(path, target)
        if not target.is_file():
            return None
        name = f"{batch_id}_{'output' if kind == 'output' else 'error'}.jsonl"
        return self._describe(file_id, name, "batch_output", owner)["id"]

    # ---- objects --------------------------------------------------------------------------------
    def _write(self, path: Path, obj: dict, within_budget: bool) -> None:
        """`obj` written whole as `path` (a temporary file, then a rename), 0600, and counted;
        `within_budget`: 413 (nothing written) when it does not fit. The caller holds `_lock`."""
        data = json.dumps(obj).encode()
        old = path.stat().st_size if path.is_file() else 0
        if within_budget and self.used + len(data) - old > self.disk_budget:
            raise _store_full(self.disk_budget)
        temp = path.with_suffix(TEMP)
        with open_private(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)
        self.used += len(data) - old

    def _object(self, kind: str, folder: Path, object_id: str, param: str) -> dict | None:
        """The object `object_id` names, None when there is none or it cannot be read."""
        path = folder / f"{_checked_id(object_id, kind, param)}.json"
        return self._read(kind, path) if path.is_file() else None

    def _objects(self, kind: str, folder: Path) -> list[dict]:
        found = (self._read(kind, p) for p in folder.glob(f"{kind}[-_]*.json")
                 if IDS[kind].fullmatch(p.stem))
        return [o for o in found if o is not None]

    def _read(self, kind: str, path: Path) -> dict | None:
        """An object file's object; None, logged once, when it is not one (cut short, not
        JSON, or missing a field)."""
        try:
            obj = json.loads(path.read_bytes())
            shape = SHAPES[kind]
            ok = (isinstance(obj, dict) and obj.get("id") == path.stem
                  and all(isinstance(obj.get(k), t) for k, t in shape.items()))
        except FileNotFoundError:  # deleted since it was listed
            return None
        except (OSError, ValueError, RecursionError) as e:
            ok, obj = False, e
        if ok:
            return obj
        if path.name not in self._reported:
            self._reported.add(path.name)
            log.warning("the Batch API's store: %s is not a %s object (%s): left out", path, kind,
                        "unreadable" if isinstance(obj, Exception) else "cut short or damaged")
        return None


def _checked_id(value: str, kind: str, param: str | None = None) -> str:
    """An id as this store names them (`file-` or `batch_` and 32 hex digits): nothing else
    reaches the file system."""
    if not IDS[kind].fullmatch(value):
        raise ProtocolError(f"No such {kind}: {value[:80]!r}", param or f"{kind}_id", status=404,
                            code="not_found")
    return value


def _store_full(budget: int) -> ProtocolError:
    return ProtocolError(f"the Batch API's store is full: its files, batches and answers may "
                         f"take {budget} bytes (--batch-disk-gb); delete files you no longer need",
                         None, status=413, code="batch_store_full")


def _unlink(path: Path) -> int:
    """Remove `path`; the bytes it took (0 when there was none)."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size
