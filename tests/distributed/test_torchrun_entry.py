"""`torchrun -m cli.torchrun_entry`: two ranks from torchrun's environment
(env:// rendezvous, no launcher) answer a JSONL file as one rank does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine import LLM, SamplingParams
from tests.distributed.conftest import ragged_prompts

pytestmark = pytest.mark.slow


def test_two_torchrun_ranks_answer_a_jsonl_file(tmp_path: Path, demo_dir: str) -> None:
    prompts = ragged_prompts(5, vocab=8000, max_len=30)
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts)
        + json.dumps({"prompt": "Hello", "params": {"max_tokens": 3}})
        + "\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "cli.torchrun_entry",
        "--model",
        demo_dir,
        "--enforce-eager",
        "--deterministic",
        "--num-pages",
        "512",
        "--max-running",
        "8",
        "--max-tokens",
        "6",
        "--prompts",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
    ]
    env = os.environ | {"COMPILED_ENGINE_TP_DEBUG": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(
        (json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()),
        key=lambda d: d["index"],
    )
    llm = LLM(demo_dir, deterministic=True, enforce_eager=True, num_pages=512, max_running=8)
    expected = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [d["token_ids"] for d in lines[:5]] == [o.token_ids for o in expected]
    assert len(lines[5]["token_ids"]) <= 3 and lines[5]["text"] == llm.tokenizer.decode(
        lines[5]["token_ids"], skip_special_tokens=True
    )
