"""Regional compilation: the decoder layers share their compiled code, so inductor compiles for a
6-layer model exactly what it compiles for a 2-layer model of the same shape (the same graphs and
generated kernels; dynamo still walks every layer's call, and the ops it records grow with depth),
and the model gives transformers' tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import metrics

from compiled_engine import LLM, SamplingParams
from compiled_engine.models.demo import demo_model_dir
from compiled_engine.runner import precompiled
from tests.helpers.checkpoints import hf_greedy, hf_model, make_checkpoint

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 42, 9, 3], [100, 7]]


def compiled_work(path: str, cache: Path) -> dict[str, int]:
    """What compiling `path`'s graphs (a cold cache) made: graphs inductor compiled (ahead of time
    or lazily), ops dynamo recorded, kernels inductor generated."""
    torch._dynamo.reset()
    graphs = lambda: precompiled.counts["compiled"] + counters["inductor"]["fxgraph_cache_miss"]  # noqa: E731
    before = (graphs(), counters["stats"]["calls_captured"], metrics.generated_kernel_count)
    llm = LLM(path, compile_cache_dir=str(cache), num_pages=256, max_running=4)
    assert llm.engine.compile_report.status == "miss"
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    hf = hf_model(path)
    assert [o.token_ids for o in out] == [hf_greedy(hf, p, 6) for p in PROMPTS]
    after = (graphs(), counters["stats"]["calls_captured"], metrics.generated_kernel_count)
    llm.engine.shutdown()
    return dict(zip(("graphs", "ops_traced", "kernels"), (a - b for a, b in zip(after, before))))


def checkpoint(path: Path, layers: int) -> str:
    make_checkpoint(str(path), "LlamaForCausalLM", num_hidden_layers=layers)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_model_dir()) / name, path / name)
    return str(path)


def test_layers_share_compiled_code(tmp_path: Path) -> None:
    shallow, deep = checkpoint(tmp_path / "2", 2), checkpoint(tmp_path / "6", 6)
    two, six = (
        compiled_work(shallow, tmp_path / "cache-2"),
        compiled_work(deep, tmp_path / "cache-6"),
    )
    print(f"compiled for 2 layers: {two}; for 6 layers: {six}")
    # prefill, decode at batch 1, decode at any batch
    assert two["graphs"] == 3 and two["kernels"] > 0
    assert (six["graphs"], six["kernels"]) == (two["graphs"], two["kernels"])
