"""The stores under one --kv-cache-dir and the one byte budget over all of them.

A store per run key (model, dtype, KV layout, TP size...) and TP rank: `<key>-<rank>`, the key 16
hex digits. Rank r's store may hold `budget // tp_size` bytes, so that a run's stores together keep
to the budget. The stores of other keys (another model, an older layout: stale) count against TP
rank 0's share and are removed whole, least recently used first, before any page of its own. One
server uses a folder at a time: rank 0 holds the folder's lock while it runs, so that no store it
removes is in use."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from compiled_engine.kv_tier.store import PageStore, lock_store_folder
from compiled_engine.private_dir import UnsafeFolder, check_private_dir, ensure_private_dir

log = logging.getLogger(__name__)

STORE_NAME = re.compile(r"[0-9a-f]{16}(-[0-9]+)?")  # a store's folder (without a rank: older ones)


def store_name(key: bytes, rank: int) -> str:
    return f"{key.hex()[:16]}-{rank}"


def stores(folder: Path) -> list[Path]:
    """The store folders in `folder`; UnsafeFolder for one that is not a folder of this user."""
    found = []
    for path in sorted(folder.iterdir()):
        if not STORE_NAME.fullmatch(path.name):
            continue
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise UnsafeFolder(f"{path} is not a folder of this user (uid {os.geteuid()}): "
                               "refusing the KV tier directory")
        found.append(path)
    return found


def check_folder(folder: str | Path) -> None:
    """UnsafeFolder when `folder` (if it exists) or a folder above it fails
    `private_dir.check_private_dir`, or a store in it is another user's (start-up flags are
    checked before any rank starts)."""
    real = check_private_dir(Path(folder).expanduser())
    if real.is_dir():
        stores(real)


def open_store(folder: str | Path, key: bytes, rank: int, world: int,
               budget_bytes: int) -> PageStore:
    """TP rank `rank`'s store of run key `key` under `folder` (0700, this user's; FolderBusy when
    another server uses it), with its share of `budget_bytes`; rank 0's share also covers the
    stores of other keys, removed as its own pages need the room."""
    folder = ensure_private_dir(Path(folder).expanduser())
    found = stores(folder)
    held = lock_store_folder(folder) if rank == 0 else None
    run = store_name(key, 0).removesuffix("0")
    stale = [p for p in found if not p.name.startswith(run)] if rank == 0 else []
    if stale:
        log.info("KV tier: %s also holds %d stores of other models or layouts: never read here, "
                 "removed as the budget needs", folder, len(stale))
    try:
        return PageStore(folder / store_name(key, rank), budget_bytes // world, stale=stale,
                         held=held)
    except BaseException:
        if held is not None:
            held.close()
        raise
