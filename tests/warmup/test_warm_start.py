"""End to end: `compiled-engine warmup` fills the cache; a fresh process then starts with every
graph loaded precompiled from it, and serves, without tracing with dynamo (counters, not timings); a
damaged entry is rebuilt, not crashed on.

A one-layer random Llama keeps the compiles short. The engine-source part of the key is pinned in
these processes: the checkout may be edited while the test runs (a real edit must miss, see
test_cache_key.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine.models.demo import DEMO_CONFIG
from compiled_engine.runner.compile_cache import list_entries

pytestmark = pytest.mark.slow

TINY = DEMO_CONFIG | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
SHAPE = ["--buckets", "1,2", "--max-running", "4", "--num-pages", "64", "--load-format", "dummy"]

PIN_SOURCES = "import compiled_engine.runner.compile_cache.key as k; k.TRACED_SOURCES = ()\n"

WARMUP = (
    PIN_SOURCES
    + "import sys; from cli.main import main; sys.exit(main(sys.argv[1:]))\n"
)

START = PIN_SOURCES + """
import json, logging, sys
from torch._dynamo.utils import counters
from compiled_engine.config import EngineConfig
from compiled_engine.runner import precompiled
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.startup import build_engine
logging.basicConfig(level=logging.INFO, format="%(message)s")
engine = build_engine(EngineConfig(model=sys.argv[1], load_format="dummy", buckets=[1, 2],
                                   max_running=4, num_pages=64, compile_cache_dir=sys.argv[2]))
warm_up = {"stats": dict(counters["stats"]), "precompiled": dict(precompiled.counts)}
# prefill, then decode batches of 3 (beyond), 2 and 1
for i, prompt in enumerate([[1, 2, 3], [4, 5], [6]]):
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2 + 2 * i, ignore_eos=True))
while engine.has_work():
    engine.step()
print(json.dumps({"inductor": counters["inductor"], "aot_autograd": counters["aot_autograd"],
                  "warm_up": warm_up, "stats": counters["stats"],
                  "precompiled": precompiled.counts}))
"""


def run(code: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    # CI sets one for the run
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "ci-wide-inductor")}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=400, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def start(model: Path, cache: Path, tmp: Path) -> tuple[dict, str]:
    out = run(START, str(model), str(cache), tmp=tmp)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("warmup")
    model, cache = tmp / "model", tmp / "compile"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = run(WARMUP, "warmup", "--model", str(model), *SHAPE, "--cache-dir", str(cache), tmp=tmp)
    assert "compile cache miss" in out.stderr
    return model, cache, tmp


def test_warm_start_loads_every_graph_precompiled_and_never_traces(
    warmed: tuple[Path, Path, Path],
) -> None:
    model, cache, tmp = warmed
    [entry] = list_entries(cache)
    assert entry.problem() is None
    graphs = sorted(p.name for p in entry.precompiled_dir.iterdir())
    assert graphs == ["decode-1.bin", "decode-2.bin", "decode-dynamic.bin", "extend.bin"]
    assert not (tmp / "ci-wide-inductor" / "fxgraph").exists()
    counts, log = start(model, cache, tmp)
    assert counts["warm_up"]["precompiled"] == {"loaded": 4}
    # and no guard sent a serving step to the fallback
    assert counts["precompiled"] == {"loaded": 4}
    assert (
        counts["stats"].get("unique_graphs", 0) == 0
        and counts["stats"].get("calls_captured", 0) == 0
    )
    assert counts["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert counts["aot_autograd"].get("autograd_cache_miss", 0) == 0
    assert "compile cache hit" in log


def test_list_shows_the_entry_and_its_key(warmed: tuple[Path, Path, Path]) -> None:
    _, cache, tmp = warmed
    out = run(WARMUP, "warmup", "--list", "--cache-dir", str(cache), tmp=tmp).stdout
    [entry] = list_entries(cache)
    assert (
        entry.digest in out
        and "complete" in out
        and "buckets: [1, 2]" in out
        and "num_pages: 64" in out
    )


def test_a_damaged_entry_is_rebuilt_not_crashed_on(warmed: tuple[Path, Path, Path]) -> None:
    model, cache, tmp = warmed
    copy = tmp / "damaged"
    shutil.copytree(cache, copy, ignore=shutil.ignore_patterns(".locks"))
    [entry] = list_entries(copy)
    biggest = max(
        (p for p in entry.inductor_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    counts, log = start(model, copy, tmp)
    assert "rebuilding" in log and "compile cache miss" in log
    assert counts["warm_up"]["precompiled"] == {"compiled": 4}
    assert entry.problem() is None
