"""`compiled-engine serve` as a user runs it: URL printed when ready, SIGTERM -> exit 0, no
orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from compiled_engine.ranks.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_serve_prints_url_serves_and_exits_cleanly_on_sigterm() -> None:
    port = free_port()
    cli = Path(sys.executable).with_name("compiled-engine")
    proc = subprocess.Popen(
        [
            str(cli),
            "serve",
            "--model",
            "demo",
            "--port",
            str(port),
            "--enforce-eager",
            "--num-pages",
            "1024",
            "--max-running",
            "8",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if f"http://127.0.0.1:{port}" in line and "serving" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        else:
            raise AssertionError("serve exited before printing its URL:\n" + "".join(lines))
        assert any("random weights" in line for line in lines), (
            "the demo model must be labelled as random weights"
        )
        ranks = _children(proc.pid)
        assert ranks, "no engine rank process"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert http.get("/health").status_code == 200
            out = http.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            ).json()
            assert out["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks):
            assert time.monotonic() < deadline, "engine rank processes were orphaned"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_chat_streams_replies_and_handles_commands() -> None:
    cli = Path(sys.executable).with_name("compiled-engine")
    out = subprocess.run(
        [
            str(cli),
            "chat",
            "--model",
            "demo",
            "--enforce-eager",
            "--num-pages",
            "512",
            "--max-running",
            "2",
            "--max-tokens",
            "4",
        ],
        input="hi\n/reset\nhello there\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "random weights" in out.stderr
    replies = [line for line in out.stdout.split("> ") if line.strip()]
    # two messages answered; /reset answered nothing; /exit stopped
    assert len(replies) == 2, out.stdout
