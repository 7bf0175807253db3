"""TP=2 with the defaults (compiled graphs): `warmup --tp 2` fills each rank's cache entry, then the
offline `LLM` and `serve` start warm (every rank reports a hit) and answer a concurrent ragged load
exactly as TP=1 and transformers do, with log-probs that do not depend on the batch. Before the
vocab all-gather left the graphs, compiling any TP graph raised `arg type Any is not yet supported
by custom_op_wrapper`."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.ranks.launcher import free_port
from compiled_engine.runner.compile_cache import list_entries
from compiled_engine.sampling_params import StructuredOutput
from tests.distributed.conftest import hf_greedy, ragged_prompts
from tests.helpers.servers import slow_schema, start_server

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
# The settings of every engine below (the compile-cache key covers them): buckets 1, 2, 4, 8.
SETTINGS = dict(num_pages=1024, max_running=8, chunk_budget=64, deterministic=True)


@pytest.fixture(scope="module")
def warm_root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("compile-cache")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "warmup",
            "--model",
            "demo",
            "--tp",
            "2",
            "--num-pages",
            "1024",
            "--max-running",
            "8",
            "--deterministic",
            "--cache-dir",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], out.stdout
    assert all("compile cache miss" in line for line in lines), out.stdout
    assert len(list_entries(Path(root))) == 2, "one cache entry per rank"
    return str(root)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return ragged_prompts(12, vocab=8000)


# constrained requests mixed with plain ones: a regex, a choice, and a schema that takes a second to
# compile (so that a rank may lag behind rank 0)
_DIGITS = dataclasses.replace(GREEDY, ignore_eos=False,
                              structured=StructuredOutput("regex", "[0-9]{3}"))
MIXED = [
    _DIGITS,
    GREEDY,
    dataclasses.replace(_DIGITS, structured=StructuredOutput("choice", ("yes", "no"))),
    GREEDY,
    dataclasses.replace(_DIGITS, structured=StructuredOutput("json", slow_schema(200, "tp"))),
]


@pytest.fixture(scope="module")
def tp1(demo_dir: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """TP=1's tokens (eager) for the prompts, and for the first five under MIXED."""
    llm = LLM(demo_dir, enforce_eager=True, **SETTINGS)
    tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(demo_dir, prompts, NEW_TOKENS)
    mixed = [o.token_ids for o in llm.generate(prompts[:5], MIXED)]
    llm.engine.shutdown()
    return tokens, mixed


@pytest.fixture(scope="module")
def tp1_tokens(tp1) -> list[list[int]]:
    return tp1[0]


def test_offline_tp2_compiled_starts_warm_and_equals_tp1(
    demo_dir: str, warm_root: str, prompts: list[list[int]], tp1
) -> None:
    tp1_tokens, tp1_mixed = tp1
    tp2 = LLM(demo_dir, tp_size=2, tp_debug=True, compile_cache_dir=warm_root, **SETTINGS)
    try:
        summaries = tp2.engine.handle.ready.compile_summaries
        assert len(summaries) == 2 and all(s.startswith("compile cache hit") for s in summaries), (
            summaries
        )
        got = tp2.generate(prompts, GREEDY)  # one concurrent ragged batch
        repeat = tp2.generate(prompts[2:6], GREEDY)  # radix hits, in a batch of 4
        alone = tp2.generate(prompts[7:8], GREEDY)
        # constrained requests wait for their grammar outside the steps (each rank compiles it);
        # rank 0 admits them for both ranks at once (tp_debug compares the ranks' plans at every
        # step)
        mixed = tp2.generate(prompts[:5], MIXED)
        # a constraint the ranks cannot compile fails the call (after the others were queued) and
        # leaves nothing running: the next call is served
        bad = dataclasses.replace(GREEDY, structured=StructuredOutput("regex", "(unclosed"))
        with pytest.raises(ValueError, match="invalid regex constraint"):
            tp2.generate(prompts[:3], [GREEDY, bad, GREEDY])
        assert not tp2.engine.has_work()
        again = tp2.generate(prompts[:5], MIXED)
    finally:
        tp2.engine.shutdown()
    assert re.fullmatch("[0-9]{3}", mixed[0].outputs[0].text), mixed[0].outputs[0].text
    assert mixed[2].outputs[0].text in ("yes", "no")
    assert mixed[4].outputs[0].text.startswith('{"p0tp": "'), mixed[4].outputs[0].text
    assert [o.token_ids for o in mixed] == [o.token_ids for o in again] == tp1_mixed
    assert [o.token_ids for o in got] == tp1_tokens
    assert [o.token_ids for o in repeat] == tp1_tokens[2:6]
    # Deterministic mode at TP=2: the ranks reduce in a fixed order, so log-probs repeat bit for bit
    # whatever the batch (TP=1 sums each product in one chain, TP=2 in two halves: equal tokens, not
    # equal bits).
    assert [o.outputs[0].logprobs for o in repeat] == [o.outputs[0].logprobs for o in got[2:6]]
    assert alone[0].outputs[0].logprobs == got[7].outputs[0].logprobs


def test_serve_tp2_compiled_answers_concurrent_requests_as_tp1(
    warm_root: str, prompts: list[list[int]], tp1_tokens: list[list[int]]
) -> None:
    running = start_server(
        engine={"tp_size": 2, "enforce_eager": False, "compile_cache_dir": warm_root, **SETTINGS}
    )
    try:
        summaries = running.state.client.handle.ready.compile_summaries
        assert all(s.startswith("compile cache hit") for s in summaries), summaries
        body = {"sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
        with running.http() as client, ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(
                pool.map(lambda p: client.post("/generate", json=body | {"input_ids": p}), prompts)
            )
    finally:
        running.stop()
    assert [r.status_code for r in replies] == [200] * len(prompts)
    assert [r.json()["output_ids"] for r in replies] == tp1_tokens


def test_offline_tp2_compiled_with_speculation_equals_tp1(demo_dir: str, warm_root: str) -> None:
    """n-gram drafts on both ranks (each proposes the same from the same ledger): TP=1's greedy
    tokens. The random model repeats what a `logit_bias` towards a planted segment makes it repeat,
    so that drafts are accepted."""
    rng = random.Random(3)
    prompts, params = [], []
    for n in (4, 6, 9, 5):
        seg = [rng.randrange(3, 7990) for _ in range(n)]
        prompts.append([1, *seg, *[rng.randrange(3, 7990) for _ in range(3)], *seg[: n // 2]])
        params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                     logit_bias={t: 8.0 for t in seg}))
    tp1 = LLM(demo_dir, enforce_eager=True, **SETTINGS)
    want = [o.token_ids for o in tp1.generate(prompts, params)]
    tp1.engine.shutdown()
    tp2 = LLM(demo_dir, tp_size=2, compile_cache_dir=warm_root, **SETTINGS,
              speculative={"method": "ngram", "num_speculative_tokens": 4,
                           "disable_by_batch_size": 8})
    try:
        got = [o.token_ids for o in tp2.generate(prompts, params)]
        stats = tp2.engine.scheduler.stats()
    finally:
        tp2.engine.shutdown()
    assert got == want
    assert stats.spec_num_accepted_tokens > 0


def _torchrun_node(node: int, master_port: int, http_port: int, warm_root: str, log: Path):
    """One "host" of a two-host torchrun job on loopback: one process, TP rank `node`."""
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
        "-m", "cli", "serve", "--model", "demo", "--port", str(http_port),
        "--compile-cache-dir", warm_root, "--num-pages", "1024", "--max-running", "8",
        "--chunk-budget", "64", "--deterministic",
    ]
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | {"COMPILED_ENGINE_TP_DEBUG": "1"})


def test_serve_under_torchrun_on_two_hosts_equals_tp1_and_fails_cleanly(
    tmp_path: Path, warm_root: str, prompts: list[list[int]], tp1_tokens: list[list[int]]
) -> None:
    """`torchrun --nnodes 2 ... -m cli serve`: rank 0 serves HTTP, TP=2 over gloo
    across the two "hosts", greedy tokens equal TP=1's; a rank killed on host 1 fails the replica
    at once (503 on /health, so a router routes around it) and both hosts' jobs end."""
    master, port = free_port(), free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [_torchrun_node(n, master, port, warm_root, logs[n]) for n in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in nodes), logs[0].read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        assert httpx.get(url + "/server_info").json()["tp_size"] == 2
        body = {"sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(8) as pool:
            replies = list(
                pool.map(lambda p: client.post("/generate", json=body | {"input_ids": p}), prompts)
            )
        assert [r.status_code for r in replies] == [200] * len(prompts)
        assert [r.json()["output_ids"] for r in replies] == tp1_tokens

        (rank1,) = psutil.Process(nodes[1].pid).children()  # torchrun's worker on host 1
        rank1.kill()
        health = httpx.get(url + "/health", timeout=30)
        for _ in range(60):
            if health.status_code == 503:
                break
            time.sleep(0.5)
            health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and "engine rank 0" in health.json()["reason"], health.text
        r = httpx.post(url + "/generate", json=body | {"input_ids": prompts[0]}, timeout=30)
        assert r.status_code == 503, r.text
        for p in nodes:
            assert p.wait(120) != 0  # each host's torchrun ends, reporting the failure
    finally:
        for p in nodes:
            if p.poll() is None:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                p.kill()
                p.wait(30)
