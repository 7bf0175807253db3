"""A model that does not split over `--tp` ranks is refused before any rank starts, in one line
naming the sizes that fit (SmolLM2: 9 query heads, 3 KV heads, intermediate 1536: --tp 1 or 3)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from compiled_engine import LLM
from compiled_engine.models.tp_fit import check_tp_size, tp_sizes
from compiled_engine.ranks.launcher import EngineStartError

ROOT = Path(__file__).resolve().parents[2]


def test_tp_sizes_follow_heads_kv_heads_and_intermediate_size() -> None:
    def config(heads: int, kv_heads: int, intermediate: int) -> dict:
        return LlamaConfig(
            hidden_size=64 * heads,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=intermediate,
        ).to_dict()

    assert tp_sizes(config(9, 3, 1536)) == [1, 3]
    # KV heads replicated when there are fewer than ranks
    assert tp_sizes(config(8, 2, 64)) == [1, 2, 4, 8]
    # 3 and 6 split neither 4 KV heads nor are multiples
    assert tp_sizes(config(12, 4, 96)) == [1, 2, 4, 12]


def test_check_names_the_valid_sizes_for_smollm2() -> None:
    check_tp_size("smollm2", 3)
    with pytest.raises(
        ValueError,
        match=r"--tp 2 does not fit smollm2: num_attention_heads=9 .*valid --tp values "
        r"for this model: 1, 3$",
    ):
        check_tp_size("smollm2", 2)


def test_serve_with_a_tp_that_does_not_fit_prints_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server", "--model", "smollm2", "--tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "valid --tp values for this model: 1, 3" in lines[0], done.stderr


def test_offline_engine_refuses_before_spawning_a_rank() -> None:
    # a session fixture's server may hold ranks already
    before = set(multiprocessing.active_children())
    with pytest.raises(EngineStartError, match="valid --tp values for this model: 1, 3"):
        LLM("smollm2", tp_size=2)
    assert set(multiprocessing.active_children()) <= before
