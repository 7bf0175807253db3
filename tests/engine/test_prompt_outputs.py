"""Prompt log-probs and embeddings in the offline API (`SamplingParams.prompt_logprobs`,
`LLM.embed`): eager fp32 against transformers fp32; in bf16 (deterministic, the default) the same
bits whatever the batch, the chunking and the prefix cache; the prefix cache is skipped at
admission only by the requests that need every prompt position."""

from __future__ import annotations

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from tests.engine.conftest import ragged_prompts

PROMPTS = ragged_prompts(9, seed=4)


@pytest.fixture(scope="module")
def hf(demo_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)


def hf_outputs(hf, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers fp32: each next prompt token's log-prob, and the final hidden states."""
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), out.hidden_states[-1][0]


def test_eager_fp32_equals_transformers(demo_dir: str, hf) -> None:
    llm = LLM(demo_dir, dtype="float32", enforce_eager=True, num_pages=512, max_running=8,
              chunk_budget=32)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    last, mean = llm.embed(PROMPTS), llm.embed(PROMPTS, pooling="mean")
    norm = torch.nn.functional.normalize
    for prompt, out, a, b in zip(PROMPTS, outs, last, mean, strict=True):
        ref_lp, states = hf_outputs(hf, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        got = torch.tensor([e[0] for e in out.prompt_logprobs[1:]])
        assert (got - ref_lp).abs().max().item() <= 1e-4 if len(prompt) > 1 else got.numel() == 0
        assert (torch.tensor(a) - norm(states[-1], dim=0)).abs().max().item() <= 1e-5
        assert (torch.tensor(b) - norm(states.mean(0), dim=0)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_bf16_same_bits_whatever_the_batch_chunking_and_cache(demo_dir: str,
                                                               enforce_eager: bool) -> None:
    def run(chunk_budget: int, together: bool) -> tuple[list, list]:
        llm = LLM(demo_dir, dtype="bfloat16", enforce_eager=enforce_eager, num_pages=1024,
                  max_running=16, chunk_budget=chunk_budget, page_size=4)
        params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
        if together:
            outs = llm.generate(PROMPTS, params)
            vectors = llm.embed(PROMPTS, pooling="mean")
        else:
            outs = [llm.generate([p], params)[0] for p in PROMPTS]
            vectors = [llm.embed([p], pooling="mean")[0] for p in PROMPTS]
        # the prompts are cached now: a plain request hits, these recompute
        stats = llm.engine.scheduler.stats
        hits = stats().prefix_cache_hits
        again = llm.generate(PROMPTS[:2], params)
        assert stats().prefix_cache_hits == hits
        assert [o.prompt_logprobs for o in again] == [o.prompt_logprobs for o in outs[:2]]
        assert llm.embed(PROMPTS[:2], pooling="mean") == vectors[:2]
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
        assert stats().prefix_cache_hits > hits
        return [o.prompt_logprobs for o in outs], vectors

    reference = run(256, together=False)
    assert run(256, together=True) == reference
    assert run(8, together=True) == reference  # every long prompt split over several steps


def test_embedding_and_scoring_requests_generate_nothing(demo_dir: str) -> None:
    llm = LLM(demo_dir, enforce_eager=True, num_pages=256, max_running=4)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert [o.outputs[0].token_ids for o in out] == [[], []]
    assert [o.finish_reason for o in out] == ["length", "length"]
    assert all(e is None or e[2] == [] for o in out for e in o.prompt_logprobs)
    with pytest.raises(ValueError, match="max_tokens must be 0"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, pooling="last"))
    with pytest.raises(ValueError, match="pooling must be"):
        llm.embed(PROMPTS[:1], pooling="cls")
    assert llm.engine.scheduler.stats().num_running == 0
    assert not llm.engine.has_work()
