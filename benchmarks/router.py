"""`bench router`: replicas of `serve` behind the field's routers, beside one replica alone.

- overhead: one replica, requests alternating between the replica directly and a router in front
  of it (one at a time, a short unique prompt, one token each): the router's added latency is the
  difference of the medians.
- hit rates: a multi-tenant chat workload (tenants x questions over long system prompts, shuffled,
  from `concurrency` clients) through each router's `cache_aware` and `round_robin` over all the
  replicas, and to one replica alone; each run's prompt-token hit rate from the replicas' own
  `/metrics` (`vllm:prefix_cache_hits_total / ..._queries_total`), its wall time and latency. Each
  run has its own tenants (a seed each), so what an earlier run cached does not help it.

The replicas are `compiled-engine serve` processes on loopback, each pinned to its own share of this
machine's cores (one torch thread per core), so that they do not fight over the cores as replicas on
separate machines would not; the replica alone is one of them, so its numbers are one replica's.
`--serve-args` reaches each one (a KV pool that holds a few tenants, e.g. `--num-pages`, is what
makes routing matter).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from compiled_engine.ranks.launcher import free_port

ROUTERS = {
    "sglang": [sys.executable, "-m", "sglang_router.launch_router"],
    "vllm": [str(Path(sys.executable).parent / "vllm-router")],
}
WORDS = ("river", "garden", "cloud", "engine", "paper", "silver", "window", "market", "forest",
         "signal", "harbor", "lantern")


def wait_until(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until GET `url` answers 200 (RuntimeError with the log's tail if `proc` exits first or time
    runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up in {timeout_s:.0f}s: {log.read_text()[-3000:]}")
        time.sleep(0.1)


@dataclass
class ServeProcess:
    """A `compiled-engine serve` process in its own process group (so that `kill` reaches its
    engine ranks too)."""

    args: list[str]
    log: Path
    port: int = 0
    cpus: frozenset[int] | None = None  # pinned to these cores, one torch thread each
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> None:
        """Launch and wait until it serves."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting for it (`wait_ready`): replicas then start together."""
        env, pin = os.environ, None
        if self.cpus is not None:
            env = env | {"OMP_NUM_THREADS": str(len(self.cpus))}
            pin = functools.partial(os.sched_setaffinity, 0, self.cpus)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "serve", *self.args,
                 "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                preexec_fn=pin,
            )

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until the launched process answers `/health`."""
        assert self.proc is not None, "launch() first"
        wait_until(self.url + "/health", self.proc, self.log, timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@contextlib.contextmanager
def running_router(
    kind: str, policy: str, worker_urls: list[str], log: Path, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """`kind`'s router (`ROUTERS`) over `worker_urls` on a free loopback port, until the block
    ends; yields its URL once it routes."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*ROUTERS[kind], "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--policy", policy, "--worker-urls", *worker_urls, *extra],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(url + "/v1/models", proc, log, 60.0)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def worker_healthy(router: str, worker: str) -> bool:
    """Whether the router lists `worker` as healthy now (`GET /workers`, both routers)."""
    workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
    return any(w["url"] == worker and w["is_healthy"] for w in workers)


def metric(url: str, name: str) -> float:
    """A replica's Prometheus sample `name` (unlabelled) now."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def prefix_counts(url: str) -> tuple[float, float]:
    """A replica's prompt tokens found in its prefix cache and looked up, so far."""
    return (metric(url, "vllm:prefix_cache_hits_total"),
            metric(url, "vllm:prefix_cache_queries_total"))


def tenant_workload(
    tenants: int, questions: int, system_words: int, seed: int, model: str
) -> list[dict]:
    """Chat requests: `tenants` system prompts of `system_words` words, `questions` short questions
    each, one token each, in a seeded shuffled order."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(system_words)) for _ in range(tenants)]
    bodies = [
        {"model": model, "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {q}: which word comes first?"}]}
        for system in systems for q in range(questions)
    ]
    rng.shuffle(bodies)
    return bodies


def run_workload(url: str, bodies: list[dict], replicas: list[str], concurrency: int) -> dict:
    """Send `bodies` to `url` from `concurrency` clients; the replicas' hit rate over the run."""
    before = [prefix_counts(r) for r in replicas]

    def one(client: httpx.Client, body: dict) -> float:
        t0 = time.perf_counter()
        client.post(url + "/v1/chat/completions", json=body).raise_for_status()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(lambda b: one(client, b), bodies))
    wall = time.perf_counter() - t0
    after = [prefix_counts(r) for r in replicas]
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return {
        "hit_rate": sum(hits) / sum(queries),
        "tokens_looked_up_per_replica": queries,
        "wall_s": wall,
        "requests_per_s": len(bodies) / wall,
        "median_latency_ms": 1e3 * statistics.median(latencies),
    }


def router_overhead(direct: str, routed: str, n: int, model: str) -> dict:
    """Requests alternating between `direct` and `routed`, one at a time, each a unique short
    prompt and one token: the medians and their difference."""
    rng = random.Random(7)
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as client:
        for i in range(2 * n):
            which, url = ("direct", direct) if i % 2 == 0 else ("router", routed)
            prompt = f"{i} " + " ".join(rng.choice(WORDS) for _ in range(24))
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            client.post(url + "/v1/completions", json=body).raise_for_status()
            times[which].append(time.perf_counter() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"direct_median_ms": med["direct"], "router_median_ms": med["router"],
            "overhead_ms": med["router"] - med["direct"], "requests_each": n}


def bench_router(
    model: str,
    serve_args: str,
    replicas: int,
    routers: list[str],
    overhead_requests: int,
    tenants: int,
    questions: int,
    system_words: int,
    concurrency: int,
    log_dir: Path,
) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--model", model, *shlex.split(serve_args)]
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // replicas)  # each replica its own cores, as on its own machine
    procs = [ServeProcess(args, log_dir / f"replica{i}.log",
                          cpus=frozenset(cores[i * share % len(cores):][:share]))
             for i in range(replicas)]
    urls = [p.url for p in procs]
    out: dict = {"model": model, "serve_args": serve_args, "replicas": replicas,
                 "cores_per_replica": share,
                 "concurrency": concurrency, "tenants": tenants, "questions": questions,
                 "overhead": {}, "workload": {}}
    try:
        for p in procs:
            p.start()
        name = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        for kind in routers:
            with running_router(kind, "round_robin", urls[:1], log_dir / f"{kind}-1.log") as url:
                out["overhead"][kind] = router_overhead(urls[0], url, overhead_requests, name)
        seeds = iter(range(100, 200))

        def workload() -> list[dict]:
            return tenant_workload(tenants, questions, system_words, next(seeds), name)

        out["workload"]["one replica alone"] = run_workload(urls[0], workload(), urls[:1],
                                                            concurrency)
        for kind in routers:
            for policy in ("cache_aware", "round_robin"):
                with running_router(kind, policy, urls, log_dir / f"{kind}-{policy}.log") as url:
                    out["workload"][f"{kind} {policy}"] = run_workload(url, workload(), urls,
                                                                       concurrency)
    finally:
        for p in procs:
            p.kill()
    return out
