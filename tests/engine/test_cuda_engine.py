"""The engine on a GPU (CUDA machines only; `scripts/gpu_check.sh` runs this module): greedy parity
with transformers on the same GPU with graphs on and off and overlap on and off (fp32 exact, bf16
within transformers' own bf16 error and diverging only at near ties), no compile and no host sync
while serving, a `cuda:N` engine that keeps everything on that GPU, and the JAX bridge's zero copy
on CUDA."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from tests.engine.conftest import ragged_prompts
from tests.helpers.oracle import Bounds, check, hf_fp32_greedy
from tests.helpers.parity import FP32, NEW_TOKENS, bf16_bounds

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 would interpret the CUDA kernels",
    ),
]

PROMPTS = ragged_prompts(12, seed=5)
ENGINE = dict(device="cuda", num_pages=4096, max_running=16, chunk_budget=128)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(demo_dir: str) -> dict[str, tuple[list, Bounds]]:
    refs = hf_fp32_greedy(demo_dir, PROMPTS, NEW_TOKENS, device="cuda")
    return {
        "float32": (refs, FP32),
        "bfloat16": (refs, bf16_bounds(demo_dir, PROMPTS, refs, "cuda")),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_parity_with_transformers_on_the_gpu(demo_dir, references, dtype: str, graphs: bool,
                                                    overlap: bool) -> None:
    refs, bounds = references[dtype]
    llm = LLM(demo_dir, dtype=dtype, enforce_eager=not graphs, overlap=overlap, **ENGINE)
    agreement = check(llm, PROMPTS, refs, bounds, f"cuda {dtype} graphs={graphs} overlap={overlap}")
    if dtype == "float32":
        assert not agreement.divergences
    if graphs:
        assert llm.engine.runner.forward.cuda_graphs  # decode steps replayed captured graphs


class CompileCounter:
    """Graphs dynamo compiles and Triton kernels JIT-compiled (new specializations) inside the
    block."""

    def __enter__(self) -> CompileCounter:
        import triton

        self.kernels: list[str] = []
        self._knobs = triton.knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = lambda **info: self.kernels.append(info["repr"])
        self._graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        return self

    def __exit__(self, *exc) -> None:
        self._knobs.jit_post_compile_hook = self._previous
        self.graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - self._graphs


def _mixed_workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Ragged prompts (1-300 tokens) with ragged outputs (4-39 tokens: min_tokens 4 fits) and
    every kind of sampling, so that the steps meet every batch size, prefill chunking, mixed steps
    and the sampler's paths."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 7990) for _ in range(rng.choice([1, 2, 7, 40, 129, 300]))]
        for _ in range(n)
    ]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=1),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.7, repetition_penalty=1.2, min_tokens=4),
        dict(temperature=0.0, logit_bias={5: 3.0}, presence_penalty=0.5),
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True, **rng.choice(kinds))
        for _ in range(n)
    ]
    return prompts, params


@pytest.mark.parametrize("deterministic", [True, False])
def test_serving_compiles_nothing(demo_dir: str, deterministic: bool) -> None:
    # the warm-up compiles here
    llm = LLM(demo_dir, dtype="bfloat16", deterministic=deterministic, **ENGINE)
    prompts, params = _mixed_workload(48, seed=1)
    with CompileCounter() as counted:
        for start in (0, 3, 20):  # batches of several sizes, from 1 request up
            llm.generate(prompts[start : start + 1 + start], params[start : start + 1 + start])
        llm.generate(prompts, params)
    assert counted.graphs == 0, "a graph compiled while serving"
    assert counted.kernels == [], f"Triton compiled while serving: {counted.kernels}"


def test_no_host_sync_between_launches(demo_dir: str) -> None:
    """Everything a step does on the host raises if it synchronizes with the GPU, except reading the
    tokens of the step before (`PendingStep.result`)."""
    llm = LLM(demo_dir, dtype="bfloat16", **ENGINE)
    engine = llm.engine
    prompts, params = _mixed_workload(24, seed=2)
    results = 0

    @contextlib.contextmanager
    def syncs_allowed():
        torch.cuda.set_sync_debug_mode("default")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("error")

    from compiled_engine.runner import model_runner

    result = model_runner.PendingStep.result

    def counted_result(self):
        nonlocal results
        results += 1
        with syncs_allowed():
            return result(self)

    step = engine.step

    def strict_step():
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model_runner.PendingStep.result = counted_result
    engine.step = strict_step
    try:
        outputs = llm.generate(prompts, params)
    finally:
        model_runner.PendingStep.result = result
        torch.cuda.set_sync_debug_mode("default")
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert results >= engine.steps  # every step's tokens were read once


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_engine_on_the_second_gpu_keeps_everything_there(demo_dir: str) -> None:
    llm = LLM(demo_dir, device="cuda:1", enforce_eager=True, num_pages=512, max_running=4)
    out = llm.generate(PROMPTS[:3], GREEDY)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in out)
    runner = llm.engine.runner
    assert torch.cuda.current_device() == 1
    assert {t.device for t in (*runner.k_caches, runner.tables.tokens)} == {torch.device("cuda", 1)}


def test_jax_sees_the_engines_cuda_tensors_without_a_copy() -> None:
    """The JAX bridge on the GPU: a logits row and its result share memory with the torch tensors
    (needs JAX's CUDA backend)."""
    pytest.importorskip("jax")
    from compiled_engine.jax import bridge

    logits = torch.randn(4, 151936, device="cuda")
    row = logits[2]
    as_jax = bridge.to_jax(row)
    assert as_jax.unsafe_buffer_pointer() == row.data_ptr()
    assert bridge.to_torch(as_jax).data_ptr() == row.data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_moe_on_the_gpu(tmp_path, dtype: str) -> None:
    """Qwen3-MoE (a dense layer among routed ones) with CUDA graphs and the Triton fused MoE op:
    transformers' greedy tokens on the same GPU (fp32 exact; bf16 within transformers' own bf16
    error), and the op equal to the portable one."""
    from kernels import ops
    from kernels.portable.moe import fused_moe as portable_fused_moe
    from tests.helpers.checkpoints import BASE, MOE, make_checkpoint

    path = make_checkpoint(str(tmp_path), "Qwen3MoeForCausalLM", torch.float32,
                           **MOE | {"norm_topk_prob": True})
    # the demo's ids, within this checkpoint's vocabulary
    prompts = [[t % BASE["vocab_size"] for t in p[:40]] for p in PROMPTS[:6]]
    refs = hf_fp32_greedy(path, prompts, NEW_TOKENS, device="cuda")
    bounds = FP32 if dtype == "float32" else bf16_bounds(path, prompts, refs, "cuda")
    llm = LLM(path, dtype=dtype, **ENGINE)
    agreement = check(llm, prompts, refs, bounds, f"cuda Qwen3-MoE {dtype}")
    if dtype == "float32":
        assert not agreement.divergences
    assert llm.engine.runner.forward.cuda_graphs
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(29, 64, device="cuda", generator=gen)
    w13 = torch.randn(4, 64, 64, device="cuda", generator=gen) / 8
    w2 = torch.randn(4, 64, 32, device="cuda", generator=gen) / 8
    ids = torch.randint(0, 3, (29, 2), device="cuda", generator=gen)  # expert 3 gets none
    weights = torch.softmax(torch.randn(29, 2, device="cuda", generator=gen), -1)
    got = ops.fused_moe(x, w13, w2, weights, ids, True)
    want = portable_fused_moe(x, w13, w2, weights, ids, False)
    assert (got - want).abs().max().item() <= 1e-3
