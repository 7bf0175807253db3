"""Logits processors in JAX through the offline API: the engine's tensors reach JAX without a copy,
a JAX rule gives exactly the tokens of the same rule built in (log-probs within 1e-5), greedy and
seeded, on the compiled and the eager engine, composes with structured output, and a processor that
fails fails its own request only."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.jax import bridge
from compiled_engine.sampling_params import StructuredOutput
from tests.engine.conftest import ragged_prompts

PROMPTS = ragged_prompts(6, seed=11)
PENALTY = 1.3


@jax.jit
def repetition_penalty(token_ids, logits):
    """The built-in repetition_penalty, in JAX: every token seen so far is pushed towards zero."""
    seen = jnp.zeros(logits.shape[0], dtype=bool).at[token_ids].set(True)
    return jnp.where(seen, jnp.where(logits > 0, logits / PENALTY, logits * PENALTY), logits)


def boost_token_5(token_ids, logits):
    return logits.at[5].add(3.0)


def raises(token_ids, logits):
    raise RuntimeError("scorer unavailable")


def wrong_shape(token_ids, logits):
    return logits[:10]


def flat(token_ids, logits):
    """Every token equally likely: the model's preferences are gone, and so would be a mask applied
    before."""
    return jnp.zeros_like(logits)


@pytest.fixture(scope="module", params=["compiled", "eager"])
def llm(request) -> LLM:
    return LLM(
        "demo",
        deterministic=True,
        enforce_eager=request.param == "eager",
        num_pages=2048,
        max_running=8,
    )


def test_the_bridge_shares_memory_both_ways() -> None:
    logits = torch.randn(3, 8000)
    row = logits[1]
    as_jax = bridge.to_jax(row)
    assert as_jax.unsafe_buffer_pointer() == row.data_ptr()
    back = bridge.to_torch(as_jax)
    assert back.data_ptr() == row.data_ptr() and torch.equal(back, row)
    ids = torch.arange(7, dtype=torch.int32)
    assert bridge.to_jax(ids).unsafe_buffer_pointer() == ids.data_ptr()


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=7)],
    ids=["greedy", "seeded"],
)
def test_a_jax_rule_gives_the_tokens_of_the_same_rule_built_in(llm: LLM, sampling: dict) -> None:
    # built in: the bias, then the penalty
    common = dict(max_tokens=16, ignore_eos=True, logprobs=2, **sampling)
    built_in = llm.generate(
        PROMPTS, SamplingParams(repetition_penalty=PENALTY, logit_bias={5: 3.0}, **common)
    )
    in_jax = llm.generate(
        PROMPTS, SamplingParams(logits_processors=(boost_token_5, repetition_penalty), **common)
    )
    plain = llm.generate(PROMPTS, SamplingParams(**common))
    for ours, theirs in zip(in_jax, built_in, strict=True):
        assert ours.token_ids == theirs.token_ids
        # XLA may divide by multiplying with the reciprocal: the last bit of a logit can differ
        assert ours.outputs[0].logprobs == pytest.approx(theirs.outputs[0].logprobs, abs=1e-5)
        assert ours.finish_reason == "length" and ours.outputs[0].error is None
    # the processors did something
    assert [o.token_ids for o in in_jax] != [o.token_ids for o in plain]


@pytest.mark.parametrize(
    ("processor", "message"),
    [(raises, "raised RuntimeError: scorer unavailable"), (wrong_shape, "expected float[8000]")],
)
def test_a_failing_processor_fails_its_request_only(llm: LLM, processor, message: str) -> None:
    good = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logits_processors=(processor,)
    )
    alone = llm.generate(PROMPTS, good)
    mixed = llm.generate(PROMPTS, [bad if i == 2 else good for i in range(len(PROMPTS))])
    failed = mixed[2].outputs[0]
    assert failed.finish_reason == "error" and message in failed.error and failed.token_ids == []
    for i, (out, ref) in enumerate(zip(mixed, alone, strict=True)):
        if i != 2:
            assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    again = llm.generate(PROMPTS[:2], good)  # the engine serves on
    assert [o.token_ids for o in again] == [o.token_ids for o in alone[:2]]
    llm.engine.scheduler.check_integrity()


def test_processors_compose_with_structured_output(llm: LLM) -> None:
    """The grammar's mask comes last: a processor can reorder the allowed tokens, never allow
    another."""
    from tests.helpers.structured import JSON, SCHEMA

    params = SamplingParams(max_tokens=128, temperature=0.8, seed=3, structured=JSON,
                            logits_processors=(repetition_penalty,))
    for out in llm.generate(["Give me JSON", "1 2 3"], params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=4)], ids=["greedy", "seeded"]
)
def test_a_processor_cannot_lift_the_mask(llm: LLM, sampling: dict) -> None:
    """A processor that sets every logit alike, under a choice constraint: the answer is still one
    of them."""
    choices = ("apple", "banana", "cherry")
    params = SamplingParams(
        max_tokens=8,
        structured=StructuredOutput("choice", choices),
        logits_processors=(flat,),
        **sampling,
    )
    for out in llm.generate(PROMPTS[:3], params):
        assert out.text in choices and out.finish_reason == "stop", out.outputs[0]


def test_processors_must_be_functions() -> None:
    with pytest.raises(ValueError, match="logits_processors must be a list of functions"):
        SamplingParams(logits_processors=("not a function",)).validate()
    SamplingParams(logits_processors=("pkg.module:function", boost_token_5)).validate()


def test_at_tp2_processors_are_named_and_every_rank_applies_them() -> None:
    """A TP engine's ranks import a processor by name ('module:function'); a function object is
    refused."""
    common = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    names = (f"{__name__}:boost_token_5", f"{__name__}:repetition_penalty")
    tp = LLM(
        "demo", deterministic=True, tp_size=2, enforce_eager=True, num_pages=512, max_running=8
    )
    try:
        with pytest.raises(ValueError, match="given by name"):
            tp.generate(PROMPTS[:1], SamplingParams(logits_processors=(boost_token_5,), **common))
        with pytest.raises(ValueError, match="cannot import"):
            tp.generate(
                PROMPTS[:1], SamplingParams(logits_processors=(f"{__name__}:missing",), **common)
            )
        named = tp.generate(PROMPTS, SamplingParams(logits_processors=names, **common))
        built_in = tp.generate(
            PROMPTS, SamplingParams(repetition_penalty=PENALTY, logit_bias={5: 3.0}, **common)
        )
    finally:
        tp.engine.shutdown()
    assert [o.token_ids for o in named] == [o.token_ids for o in built_in]


def test_a_name_that_leads_nowhere_is_refused_at_once(llm: LLM) -> None:
    with pytest.raises(ValueError, match="cannot import"):
        llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=2, logits_processors=("no_such_module:f",))
        )
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].token_ids) == 2
