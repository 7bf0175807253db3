"""`compiled-engine serve` as a user runs it: URL printed when ready, SIGTERM drains, a second
SIGTERM exits at once, exit 0, no orphans; a start the configuration rules out is one line and
exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

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


def _stream(port: int, body: dict, into: dict, key: str) -> threading.Thread:
    """POST a streamed completion on a thread; `into[key]`: its `data:` lines, the first one as
    soon as it comes (`into[key + ":first"]` set)."""
    started = into[key + ":first"] = threading.Event()

    def run() -> None:
        lines = into[key] = []
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http, \
                    http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as e:
            lines.append(f"cut: {type(e).__name__}")
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_serve_drains_on_sigterm_and_exits_on_a_second_one() -> None:
    """A user's `compiled-engine serve` and real signals: ready, serves; the first SIGTERM makes
    /health 503 while the stream in flight finishes with its finish_reason and [DONE]; a second
    SIGTERM ends the drain at once (a long stream still running is cut), the process exits 0 and
    no engine rank outlives it."""
    port = free_port()
    cli = Path(sys.executable).with_name("compiled-engine")
    proc = subprocess.Popen(
        [str(cli), "serve", "--model", "demo", "--port", str(port), "--enforce-eager",
         "--num-pages", "1024", "--max-running", "8", "--shutdown-timeout", "300"],
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
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # the log never blocks it
        base = {"prompt": "hi", "stream": True, "ignore_eos": True, "temperature": 0}
        got: dict = {}
        short = _stream(port, base | {"max_tokens": 24}, got, "short")
        long = _stream(port, base | {"max_tokens": 1900, "n": 4}, got, "long")
        for key in ("short", "long"):
            assert got[key + ":first"].wait(120), f"the {key} stream never started"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            proc.send_signal(signal.SIGTERM)
            health = http.get("/health")
            deadline = time.monotonic() + 60  # the signal's handler runs on the server's next tick
            while health.status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
                health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
        short.join(120)
        assert got["short"][-1] == "data: [DONE]", got["short"][-3:]
        assert json.loads(got["short"][-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.poll() is None and long.is_alive(), "the drain did not wait for the stream"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        long.join(60)
        finished = [c.get("finish_reason") for line in got["long"] if line.startswith("data: {")
                    for c in json.loads(line[6:]).get("choices", [])]
        assert finished.count("length") < 4, "the second SIGTERM did not cut the long stream"
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


def _unsupported_gguf(folder: Path) -> Path:
    """The demo checkpoint as a GGUF file that says it is a Falcon (an architecture not served)."""
    import gguf

    from compiled_engine.models.demo import demo_model_dir
    from tests.models._gguf_utils import write_gguf

    return write_gguf(str(demo_model_dir()), folder / "falcon.gguf", gguf.GGMLQuantizationType.F32,
                      arch="falcon")


def _refused(*flags: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("compiled-engine")
    return subprocess.run([str(cli), "serve", "--port", "0", "--enforce-eager", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["gguf architecture", "reasoning parser", "missing model"])
def test_a_refused_start_is_one_line_and_exit_code_2(case: str, tmp_path: Path) -> None:
    """What the configuration rules out, found before the ranks start, in a rank, or in the server
    after the ranks are up: one line naming the problem, exit code 2, no traceback."""
    flags, says = {
        "gguf architecture": (("--model", str(_unsupported_gguf(tmp_path))),
                              "GGUF architecture 'falcon' is not supported"),
        "reasoning parser": (("--model", "demo", "--reasoning-parser", "qwen3"),
                             "--reasoning-parser qwen3: this model's tokenizer has no single"),
        "missing model": (("--model", str(tmp_path / "nowhere")), str(tmp_path / "nowhere")),
    }[case]
    out = _refused(*flags)
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert out.returncode == 2, out.stderr
    assert len(errors) == 1 and says in errors[0], out.stderr
    assert out.stderr.splitlines()[-1] == errors[0]  # the last word, after the log's lines
    assert errors[0].startswith("compiled-engine serve: error: "), out.stderr
    assert "Traceback" not in out.stderr and '  File "' not in out.stderr


def test_a_refused_start_at_debug_level_shows_the_tracebacks(tmp_path: Path) -> None:
    out = _refused("--model", str(_unsupported_gguf(tmp_path)), "--log-level", "debug")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].startswith("compiled-engine serve: error: ")
    assert "Traceback" in out.stderr and "CheckpointError" in out.stderr  # the rank's, too
