"""Folders and files only this process's user may read: a folder is 0700 (made so, or an existing
one of ours tightened, with a warning), a file 0600 (whatever the umask). A folder owned by another
user, or one that others may write, is refused (`UnsafeFolder`): whoever controls it could read what
is kept there or plant what is read back. So is a folder with such a folder above it (its real
path's parents, as OpenSSH's StrictModes checks them): each must be root's or this user's, and
writable by no one else unless it is sticky (as /tmp), else its owner could move ours aside and put
theirs in its place. A folder that one process at a time may use is locked (`lock_folder`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

FOLDER_MODE = 0o700
FILE_MODE = 0o600
PARENT_MODE = 0o755  # a missing parent made here (less what the umask takes)
REFUSING = "refusing to keep private data there"


class UnsafeFolder(OSError):
    """A folder this process will not keep private data in (the message says why, in one line)."""


class FolderBusy(OSError):
    """Another process holds the folder's lock (the message says what to do, in one line)."""


def check_private_dir(path: str | os.PathLike) -> Path:
    """The real path of `path`, checked without changing anything: UnsafeFolder when it (if it
    exists) is not a folder, is another user's or is writable by others, or when a folder above it
    is neither root's nor this user's, or others may write it and it is not sticky."""
    real = Path(os.path.realpath(path))
    if real.exists():
        info = real.stat()
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafeFolder(f"{path} is not a folder")
        if info.st_uid != os.geteuid():
            raise UnsafeFolder(f"{path} is owned by uid {info.st_uid}, not by this user "
                               f"(uid {os.geteuid()}): {REFUSING}")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeFolder(f"{path} is writable by other users (mode "
                               f"{stat.S_IMODE(info.st_mode):o}): {REFUSING}")
    for parent in real.parents:
        if parent.exists():
            _check_parent(path, parent)
    return real


def _check_parent(path: str | os.PathLike, parent: Path) -> None:
    info = parent.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path}: {parent} is not a folder")
    if info.st_uid not in (0, os.geteuid()):
        raise UnsafeFolder(f"{path}: the folder above it, {parent}, is owned by uid "
                           f"{info.st_uid} (neither root nor this user): {REFUSING}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise UnsafeFolder(f"{path}: the folder above it, {parent}, is writable by other users "
                           f"and not sticky (mode {stat.S_IMODE(info.st_mode):o}): {REFUSING}")


def ensure_private_dir(path: str | os.PathLike, warn: bool = True) -> Path:
    """The real path of `path`, made 0700 (missing parents 0755 less the umask), or an existing
    folder of this user set to 0700 (a warning when its mode changes, unless not `warn`: a folder
    inside one that warned); UnsafeFolder, before anything is made, for what `check_private_dir`
    refuses."""
    real = check_private_dir(path)
    missing = [p for p in (real, *real.parents) if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
            folder.mkdir(mode=FOLDER_MODE if folder == real else PARENT_MODE)
    if missing:
        real = check_private_dir(path)  # what was made in the meantime checked as well
    mode = stat.S_IMODE(real.stat().st_mode)
    if mode != FOLDER_MODE:
        if warn and real not in missing:
            log.warning("%s had mode %o: set to %o (only this user may read what is kept there)",
                        path, mode, FOLDER_MODE)
        os.chmod(real, FOLDER_MODE)
    return real


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
