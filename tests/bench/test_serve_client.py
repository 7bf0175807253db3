"""`bench serve` against a fake OpenAI SSE server on 127.0.0.1: counts, timings, failures,
sessions."""

from __future__ import annotations

import asyncio
import json
import math

from benchmarks.datasets import (
    BenchRequest,
    LengthRange,
    PrefixShape,
    prefix_dataset,
)
from benchmarks.serve_run import ServeOptions, run_serve
from cli.main import main
from tests.bench.fake_openai_server import REJECTED_FIRST_ID, fake_server


def test_counts_timings_and_failures() -> None:
    sessions = [[BenchRequest([5] * 20, n)] for n in (1, 4, 8)] + [
        [BenchRequest([REJECTED_FIRST_ID] * 20, 4)]
    ]
    with fake_server() as (url, seen):
        run = asyncio.run(
            run_serve(
                url,
                "fake",
                sessions,
                ServeOptions("fake-model", request_rate=50.0, seed=1, deadline_s=30),
                lambda r: r.prompt_ids,
            )
        )
    s = run.summary
    assert (s.completed, s.failed, s.input_tokens, s.output_tokens) == (3, 1, 60, 13)
    assert run.errors and "HTTP 400" in run.errors[0]
    assert run.cache_hit_rate == 0.25
    assert len(seen) == 4 and all(
        b["stream"] and b["ignore_eos"] and b["model"] == "fake-model" for b in seen
    )
    assert s.ttft_s.p50 > 0 and s.tpot_s.p50 > 0 and s.e2e_s.p99 >= s.ttft_s.p99
    assert s.itl_s.p50 > 0


def test_turns_of_a_chat_are_sent_one_after_the_other() -> None:
    shape = PrefixShape(
        system_len=30,
        num_shared=2,
        question_len=3,
        num_chats=2,
        turns=3,
        user_len=4,
        answer_len=2,
        output_len=LengthRange(3, 3),
    )
    sessions = prefix_dataset(shape, 100, seed=0)
    with fake_server() as (url, seen):
        run = asyncio.run(
            run_serve(
                url,
                "fake",
                sessions,
                ServeOptions("fake-model", deadline_s=30),
                lambda r: r.prompt_ids,
            )
        )
    assert run.summary.completed == 2 + 2 * 3 and run.summary.failed == 0
    for chat in sessions[2:]:
        order = [next(i for i, b in enumerate(seen) if b["prompt"] == r.prompt_ids) for r in chat]
        assert order == sorted(order)


def test_bench_serve_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "serve.json"
    with fake_server() as (url, seen):
        rc = main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--label",
                "fake",
                "--model",
                "demo",
                "--num-prompts",
                "5",
                "--input-len",
                "8:16",
                "--output-len",
                "4",
                "--request-rate",
                "20,inf",
                "--timeout",
                "60",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "plots"),
            ]
        )
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = doc["result"]["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    assert all(r["summary"]["completed"] == 5 and r["summary"]["output_tokens"] == 20 for r in runs)
    assert len(seen) == 10 and all(8 <= len(b["prompt"]) <= 16 for b in seen)
    assert (tmp_path / "plots" / "serve_latency.png").stat().st_size > 0
    assert "TTFT p50 ms" in capsys.readouterr().out
    assert not math.isnan(runs[0]["summary"]["ttft_s"]["p50"])
