"""Folders and files only this process's user may read: a folder is 0700 (made so, or an existing
one of ours tightened), a file 0600 (whatever the umask); a folder owned by another user, or one
that others may write, is refused (`UnsafeFolder`): whoever controls it could read what is kept
there or plant what is read back. A folder that one process at a time may use is locked
(`lock_folder`)."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import IO

FOLDER_MODE = 0o700
FILE_MODE = 0o600


class UnsafeFolder(OSError):
    """A folder this process will not keep private data in (the message says why, in one line)."""


class FolderBusy(OSError):
    """Another process holds the folder's lock (the message says what to do, in one line)."""


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """`path` made 0700 (missing parents as `mkdir -p` makes them), or an existing folder of this
    user set to 0700;
    UnsafeFolder when it is not a folder, is owned by another user, or is writable by others."""
    path = Path(path)
    made = not path.exists()
    try:
        path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    except FileExistsError:
        raise UnsafeFolder(f"{path} is not a folder") from None
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a folder")
    if info.st_uid != os.geteuid():
        raise UnsafeFolder(f"{path} is owned by uid {info.st_uid}, not by this user "
                           f"(uid {os.geteuid()}): refusing to keep private data there")
    if not made and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"{path} is writable by other users (mode "
                           f"{stat.S_IMODE(info.st_mode):o}): refusing to keep private data there")
    if stat.S_IMODE(info.st_mode) != FOLDER_MODE:
        os.chmod(path, FOLDER_MODE)
    return path


def private_opener(path: str, flags: int) -> int:
    """An `opener` for `open()`: the file is 0600 (created so, or set so) whatever the umask."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_private(path: str | os.PathLike, mode: str = "wb"):
    """`open(path, mode)`, the file being 0600."""
    return open(path, mode, opener=private_opener)


def lock_folder(folder: Path, busy: str) -> IO:
    """An exclusive lock on `folder` (its file `lock`, 0600), held while the returned file is open;
    FolderBusy(`busy`) when another process holds it."""
    lock_file = open_private(folder / "lock", "a+")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise FolderBusy(busy) from None
    return lock_file
