"""The Batch API's state on disk (`--batch-dir`): files (`files/<id>.jsonl` and their object,
`<id>.json`) and batches (`batches/<id>.json`, and the lines answered so far,
`<id>.output.jsonl` / `<id>.errors.jsonl`, appended as they come). Objects are written whole
(a temporary file, then a rename), so a restart finds each as it last was. Blocking file work:
callers run it off the event loop."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from server.request_errors import ProtocolError

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.files = root / "files"
        self.batches = root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # writers on several threads

    # ---- files ----------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files / f"{_checked_id(file_id, 'file')}.jsonl"

    def add_file(self, temp: Path, filename: str, purpose: str) -> dict:
        """Keep the uploaded `temp` (moved) as a new file; its object."""
        file_id = f"file-{uuid.uuid4().hex}"
        shutil.move(temp, self.file_path(file_id))
        return self._describe(file_id, filename, purpose)

    def _describe(self, file_id: str, filename: str, purpose: str) -> dict:
        """Write the object of the file kept as `file_id`; the object."""
        obj = {"id": file_id, "object": "file", "bytes": self.file_path(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        _write_json(self.files / f"{file_id}.json", obj)
        return obj

    def file(self, file_id: str, param: str = "file_id") -> dict:
        """A file's object; 404 (naming `param`) without it."""
        path = self.files / f"{_checked_id(file_id, 'file', param)}.json"
        if not path.is_file():
            raise ProtocolError(f"No such File object: {file_id[:80]}", param, status=404,
                                code="not_found")
        return json.loads(path.read_text())

    def list_files(self, purpose: str | None) -> list[dict]:
        objs = [json.loads(p.read_text()) for p in self.files.glob("file-*.json")]
        objs = [o for o in objs if purpose is None or o["purpose"] == purpose]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        self.file_path(file_id).unlink(missing_ok=True)
        (self.files / f"{file_id}.json").unlink(missing_ok=True)

    # ---- batches --------------------------------------------------------------------------------
    def new_batch(self, obj: dict) -> dict:
        obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", **obj}
        self.put_batch(obj)
        return obj

    def put_batch(self, obj: dict) -> None:
        with self._lock:
            _write_json(self.batches / f"{obj['id']}.json", obj)

    def batch(self, batch_id: str) -> dict:
        path = self.batches / f"{_checked_id(batch_id, 'batch')}.json"
        if not path.is_file():
            raise ProtocolError(f"No such Batch object: {batch_id[:80]}", "batch_id", status=404,
                                code="not_found")
        return json.loads(path.read_text())

    def list_batches(self) -> list[dict]:
        objs = [json.loads(p.read_text()) for p in self.batches.glob("batch_*.json")]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def answers_path(self, batch_id: str, kind: str) -> Path:
        """Where a batch's answered lines go as they come: kind "output" or "errors"."""
        return self.batches / f"{batch_id}.{kind}.jsonl"

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
                if end != path.stat().st_size:
                    os.truncate(path, end)
            done[kind] = ids
        return done

    def append_answer(self, batch_id: str, kind: str, line: bytes) -> None:
        """One answered line (JSON, no newline), written to the file before this returns (in the
        OS's cache: a machine that stops may lose the last ones, which then run again)."""
        with self._lock, open(self.answers_path(batch_id, kind), "ab") as f:
            f.write(line + b"\n")

    def keep_answers(self, batch_id: str, kind: str, file_id: str) -> str | None:
        """A batch's answered lines of `kind` as the file `file_id` (None when there are none);
        again after a restart, it finishes a move it began."""
        path, target = self.answers_path(batch_id, kind), self.file_path(file_id)
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
        if path.is_file():
            os.replace(path, target)
        if not target.is_file():
            return None
        name = f"{batch_id}_{'output' if kind == 'output' else 'error'}.jsonl"
        return self._describe(file_id, name, "batch_output")["id"]


def _checked_id(value: str, kind: str, param: str | None = None) -> str:
    """An id as this store names them: no path separators or dots reach the file system."""
    if not (value.replace("-", "").replace("_", "").isalnum() and len(value) <= 128):
        raise ProtocolError(f"No such {kind}: {value[:80]!r}", param or f"{kind}_id", status=404,
                            code="not_found")
    return value


def _write_json(path: Path, obj: dict) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(obj))
    os.replace(temp, path)
