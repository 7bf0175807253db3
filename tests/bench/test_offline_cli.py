"""`compiled-engine bench offline` end to end on the demo model (eager, tiny sizes)."""

from __future__ import annotations

import json

from cli.main import main


def test_offline_random_with_baselines_writes_json_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "offline.json"
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            "demo",
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--enforce-eager",
            "--num-pages",
            "512",
            "--compare",
            "hf",
            "--repeats",
            "2",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "offline" and doc["machine"]["cores"] >= 1
    result = doc["result"]
    assert result["workload"]["num_requests"] == 4 and result["workload"]["prompt_tokens"] == 64
    runs = result["runs"]
    assert [r["label"] for r in runs] == ["compiled-engine (eager)", "transformers generate"]
    for r in runs:
        s = r["summary"]
        assert (s["completed"], s["failed"], s["input_tokens"], s["output_tokens"]) == (
            4,
            0,
            64,
            16,
        )
        assert s["output_throughput"] > 0
    assert runs[0]["summary"]["ttft_s"]["p50"] > 0
    # fp32 greedy: transformers (left-padded batches) generates exactly our tokens
    assert runs[1]["tokens_vs_base"] == {"identical": 4, "requests": 4, "common_prefix": 1.0}
    assert (tmp_path / "plots" / "offline_random.png").stat().st_size > 0
    printed = capsys.readouterr()
    assert "vs transformers generate" in printed.out
    # --repeats 2: both variants ran twice, alternating; the table keeps each one's best run.
    logged = [
        line.split(":")[0]
        for line in (printed.out + printed.err).splitlines()
        if "output tok/s" in line and ":" in line and not line.startswith("|")
    ]
    assert logged == ["compiled-engine (eager)", "transformers generate"] * 2


def test_offline_prefix_radix_reuses_prefixes_and_naive_does_not(tmp_path) -> None:
    out = tmp_path / "prefix.json"
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            "demo",
            "--dataset",
            "prefix",
            "--system-len",
            "48",
            "--num-shared",
            "3",
            "--num-chats",
            "2",
            "--turns",
            "2",
            "--output-len",
            "2",
            "--enforce-eager",
            "--num-pages",
            "1024",
            "--compare",
            "naive",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    radix, naive = json.loads(out.read_text())["result"]["runs"]
    assert radix["summary"]["completed"] == naive["summary"]["completed"] == 3 + 2 * 2
    assert radix["cache_hit_rate"] > 0.2 and naive["cache_hit_rate"] == 0.0  # turn 2 reuses turn 1
