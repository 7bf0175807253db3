"""`bench batch`: the same `requests` completions answered three ways, on one model and settings:
through the Batch API of a running server (`/v1/files` + `/v1/batches`, from the batch's creation
to its completion), by `compiled-engine run-batch` offline (the whole command, engine start
included, and its own time to answer once started), and by `clients` concurrent clients on the same
server. Greedy, `output_len` tokens each (no EOS), prompts of a few dozen tokens, each way its own
(its first word): no way finds another's prompts in the prefix cache."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.router import ServeProcess

POLL_S = 0.2


def _rows(model: str, requests: int, output_len: int, way: str) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"{way} request {i}: a story about the number {i} "
                      "and the river that ran past the old mill at the edge of town.",
                      "max_tokens": output_len, "temperature": 0, "ignore_eos": True}}
            for i in range(requests)]


def _via_batches(url: str, source: Path) -> float:
    with httpx.Client(base_url=url, timeout=120) as http:
        with open(source, "rb") as f:
            upload = http.post("/v1/files", files={"file": ("in.jsonl", f)},
                               data={"purpose": "batch"}).json()
        t0 = time.perf_counter()
        batch = http.post("/v1/batches", json={"input_file_id": upload["id"],
                                               "endpoint": "/v1/completions",
                                               "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(POLL_S)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        seconds = time.perf_counter() - t0
        assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
        return seconds


def _via_clients(url: str, rows: list[dict], clients: int) -> float:
    async def go() -> float:
        slots = asyncio.Semaphore(clients)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            async def one(row: dict) -> None:
                async with slots:
                    r = await http.post("/v1/completions", json=row["body"])
                    r.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(one(r) for r in rows))
            return time.perf_counter() - t0

    return asyncio.run(go())


def _via_run_batch(serve_args: list[str], source: Path, folder: Path) -> tuple[float, float]:
    """(the whole command's seconds, its own answering seconds as it reports them)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cli", "run-batch", "-i", str(source), "-o",
                          str(folder / "out.jsonl"), *serve_args],
                         capture_output=True, text=True, timeout=3600)
    total = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    answered = float(out.stderr.rsplit(" in ", 1)[1].split(" s")[0])
    return total, answered


def run(model: str, serve_args: list[str], requests: int, output_len: int, clients: int,
        log: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sources = {}
        for way in ("Batch", "Offline"):
            sources[way] = folder / f"{way}.jsonl"
            sources[way].write_text("".join(
                json.dumps(r) + "\n" for r in _rows(model, requests, output_len, way)))
        tokens = requests * output_len
        server = ServeProcess([*serve_args, "--batch-dir", str(folder / "batches")],
                              folder / "serve.log")
        log("starting the server")
        server.start()
        try:
            log(f"{requests} requests through /v1/batches")
            batches_s = _via_batches(server.url, sources["Batch"])
            log(f"{requests} requests from {clients} concurrent clients")
            clients_s = _via_clients(server.url, _rows(model, requests, output_len, "Client"),
                                     clients)
        finally:
            server.kill()
        log(f"{requests} requests through run-batch")
        run_batch_s, answering_s = _via_run_batch(serve_args, sources["Offline"], folder)
    return {
        "batches_s": batches_s, "batches_tok_s": tokens / batches_s,
        "run_batch_total_s": run_batch_s, "run_batch_answering_s": answering_s,
        "run_batch_tok_s": tokens / answering_s,
        "clients_s": clients_s, "clients_tok_s": tokens / clients_s,
        "batches_vs_clients": clients_s / batches_s,
        "run_batch_vs_clients": clients_s / answering_s,
    }
