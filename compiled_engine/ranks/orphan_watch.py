"""A launcher-spawned rank ends when the process that spawned it is gone (killed, crashed, or exited
without stopping it): nothing else stops a rank that waits on its channel or on a collective."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


def exit_with_parent() -> None:
    """Watch the spawning process from a daemon thread and end this one (exit code 1) once it is
    gone: spawn keeps a pipe open in the parent whose end (`parent_process().sentinel`) says so."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_after, args=(parent,), name="parent-watch",
                         daemon=True).start()


def _exit_after(parent: BaseProcess) -> None:
    parent.join()
    log.error("the process that started this rank (pid %s) is gone: exiting", parent.pid)
    os._exit(1)
