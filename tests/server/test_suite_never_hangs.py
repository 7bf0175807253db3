"""A failing test never hangs the suite: a server test that fails with its in-process server still
running (nothing stops it) lets pytest exit with the failure, its engine rank processes gone (the
launcher stops them when the interpreter exits; multiprocessing alone would wait for them forever).
And a server killed outright takes its ranks with it, even one stuck in its start-up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from compiled_engine.models.demo import demo_model_dir

ROOT = Path(__file__).resolve().parents[2]
EXIT_WAIT_S = 300.0  # pytest's run of one eager demo server, on a shared 2-core machine
GONE_WAIT_S = 60.0

FAILING_TEST = '''
import json
import os

from tests.helpers.servers import start_server


def test_a_server_test_that_fails():
    running = start_server(engine={"enforce_eager": True, "num_pages": 256})
    with open(os.environ["RANK_PIDS"], "w") as f:
        json.dump([p.pid for p in running.state.client.handle.procs], f)
    assert False, "deliberately"
'''

# a launcher whose only rank waits forever in its start-up: its weights file is a FIFO no one writes
STUCK_LAUNCHER = '''
import sys

from compiled_engine.config import EngineConfig
from compiled_engine.ranks.launcher import launch

launch(EngineConfig(model=sys.argv[1], enforce_eager=True, num_pages=64))
'''


def _is_rank(proc: psutil.Process) -> bool:
    """A spawned rank (not multiprocessing's resource tracker), not yet reaped."""
    try:
        cmdline = " ".join(proc.cmdline())
        return "spawn_main" in cmdline and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _alive_ranks(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if _is_rank(psutil.Process(pid)):
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _kill(pids: list[int]) -> None:
    for pid in _alive_ranks(pids):
        os.kill(pid, signal.SIGKILL)


def test_a_failing_server_test_lets_pytest_exit(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_fails.py").write_text(FAILING_TEST)
    pids_file = tmp_path / "ranks.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=ROOT, env=os.environ | {"RANK_PIDS": str(pids_file)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and the ranks it waits for
        out, _ = proc.communicate()
        pytest.fail(f"pytest did not exit within {EXIT_WAIT_S:.0f} s of its test failing:\n"
                    + out[-3000:])
    finally:
        ranks = json.loads(pids_file.read_text()) if pids_file.exists() else []
        survivors = _alive_ranks(ranks)
        _kill(ranks)
    assert "AssertionError: deliberately" in out and "1 failed" in out, out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    assert ranks and not survivors, f"engine rank processes {survivors} outlived pytest"


def test_a_killed_server_takes_its_stuck_rank_with_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir(), model)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    proc = subprocess.Popen([sys.executable, "-c", STUCK_LAUNCHER, str(model)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + GONE_WAIT_S
        while not ranks:
            assert proc.poll() is None, "the launcher exited"
            assert time.monotonic() < deadline, "the launcher started no rank"
            ranks = [p.pid for p in psutil.Process(proc.pid).children() if _is_rank(p)]
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + GONE_WAIT_S
        while _alive_ranks(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive_ranks(ranks), "the rank outlived the process that started it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill(ranks)
