"""`scripts/cluster.sh` as the README runs it: two demo replicas behind vllm-router's `kv_aware`
(the replicas publish KV events), a chat answered through the router, and Ctrl-C stops every process
it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from compiled_engine.ranks.launcher import free_port

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"


def free_pair() -> int:
    """A port p with p + 1 also free (the script numbers replicas from a base port)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


def test_cluster_script_serves_through_the_router_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    router_port = free_port()
    env = os.environ | {
        "N": "2", "BASE_PORT": str(free_pair()), "ROUTER": "vllm", "POLICY": "kv_aware",
        "ROUTER_PORT": str(router_port), "KV_BASE_PORT": str(free_pair()), "LOG_DIR": str(tmp_path),
        # the settings of the suite's other demo servers: their compile-cache entry
        "SERVE_ARGS": "--num-pages 8192 --max-running 32 --deterministic",
    }
    out = tmp_path / "stdout"
    with open(out, "w") as sink:
        proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while "router: http" not in out.read_text():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        servers = [p for p in started if p.cmdline()[1:3] == ["-m", "server"]]
        assert len(servers) == 2, [p.cmdline() for p in started]
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body,
                       timeout=60)
        assert r.status_code == 200, r.text
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        proc.wait(60)
        gone, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
