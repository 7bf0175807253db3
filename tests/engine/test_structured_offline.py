"""Structured output through the offline API, on the engine's default path (compiled) and eager
(TP=2 compiled: tests/distributed/test_tp_compiled.py): every output satisfies its constraint, and
the constraint composes with n, seeds, logprobs (of the masked distribution), min_tokens,
max_tokens, stop strings and retraction."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_engine import LLM, SamplingParams
from compiled_engine.sampling_params import StructuredOutput
from tests.helpers.structured import JSON, SCHEMA

PROMPTS = ["Hello there", "What is a cat?", "Give me JSON", "1 2 3"]


@pytest.fixture(scope="module")
def compiled() -> LLM:
    llm = LLM("demo", deterministic=True, num_pages=2048, max_running=8)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def eager() -> LLM:
    llm = LLM("demo", deterministic=True, enforce_eager=True, num_pages=2048, max_running=8)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("which", ["compiled", "eager"])
def test_json_schema_on_both_paths(request, which: str) -> None:
    llm = request.getfixturevalue(which)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=128, temperature=0, structured=JSON))
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_n_and_seeds_are_reproducible(compiled: LLM) -> None:
    params = SamplingParams(max_tokens=128, temperature=1.0, seed=5, n=3, structured=JSON)
    first = [o.text for o in compiled.generate(PROMPTS[:2], params)[0].outputs]
    again = [o.text for o in compiled.generate(PROMPTS[:2], params)[0].outputs]
    assert first == again and len(set(first)) > 1
    for text in first:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_are_those_of_the_masked_distribution(eager: LLM) -> None:
    choices = ("apple", "banana")
    out = eager.generate(
        "Fruit:",
        SamplingParams(
            max_tokens=8, temperature=0, logprobs=20, structured=StructuredOutput("choice", choices)
        ),
    )[0].outputs[0]
    assert out.text in choices
    first = [(tok, lp) for tok, lp in out.top_logprobs[0] if lp > -math.inf]
    assert len(first) < 20, "every allowed first token is among the 20 alternatives"
    assert math.isclose(sum(math.exp(lp) for _, lp in first), 1.0, rel_tol=1e-4), (
        "the mask renormalizes"
    )
    for tok, _ in first:
        piece = eager.tokenizer.decode([tok]).strip()
        assert any(c.startswith(piece) for c in choices), f"token {piece!r} is not allowed first"


def test_limits_compose_with_the_constraint(eager: LLM) -> None:
    short = eager.generate("x", SamplingParams(max_tokens=3, temperature=0, structured=JSON))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3  # an unfinished document
    done = eager.generate("x", SamplingParams(max_tokens=32, min_tokens=20, temperature=0,
                                              structured=StructuredOutput("choice", ("ab",))))[0]
    assert done.text == "ab" and done.finish_reason == "stop", (
        "a complete document ends, min_tokens or not"
    )
    stopped = eager.generate(
        "x",
        SamplingParams(
            max_tokens=32,
            temperature=0,
            stop=("-",),
            structured=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}"),
        ),
    )[0]
    assert re.fullmatch("[a-c]{3}", stopped.text) and stopped.finish_reason == "stop"


def test_retraction_keeps_the_constraint() -> None:
    """A pool so small that requests are retracted and recomputed: the grammar state survives it."""
    llm = LLM(
        "demo", deterministic=True, enforce_eager=True, num_pages=96, max_running=4, chunk_budget=32
    )
    try:
        outs = llm.generate(
            PROMPTS * 2, SamplingParams(max_tokens=40, temperature=0, structured=JSON)
        )
        assert llm.engine.scheduler.num_retractions > 0
        for out in outs:
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMA)
        plain = LLM("demo", deterministic=True, enforce_eager=True, num_pages=2048, max_running=4)
        alone = plain.generate(
            PROMPTS * 2, SamplingParams(max_tokens=40, temperature=0, structured=JSON)
        )
        assert [o.text for o in outs] == [o.text for o in alone]
    finally:
        llm.engine.shutdown()


def test_a_bad_constraint_is_rejected_and_nothing_else_is_disturbed(eager: LLM) -> None:
    with pytest.raises(ValueError, match="invalid regex constraint"):
        eager.generate(
            ["fine", "also fine"],
            [
                SamplingParams(max_tokens=2),
                SamplingParams(structured=StructuredOutput("regex", "(unclosed")),
            ],
        )
    assert not eager.engine.has_work()
    assert eager.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[
        0
    ].token_ids


_bounded = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.integers(1, 3).map(
        lambda n: {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": n,
        }
    ),
)
_schemas = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=5), _bounded, min_size=1, max_size=3
).map(lambda props: {"type": "object", "properties": props, "required": sorted(props)})


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=_schemas, seed=st.integers(0, 1000))
def test_random_schemas_always_validate(eager: LLM, schema: dict, seed: int) -> None:
    out = eager.generate(
        "JSON please",
        SamplingParams(
            max_tokens=160,
            temperature=1.0,
            seed=seed,
            structured=StructuredOutput("json", json.dumps(schema)),
        ),
    )[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_overlap_scheduling_keeps_masks_on_committed_tokens(eager: LLM) -> None:
    """With overlap a constrained request skips the step after each of its own (its next mask needs
    the token in flight); the documents still validate and unconstrained neighbours are
    token-identical."""
    llm = LLM(
        "demo", deterministic=True, enforce_eager=True, num_pages=2048, max_running=8, overlap=True
    )
    try:
        params = [SamplingParams(max_tokens=128, temperature=0, structured=JSON),
                  SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 2
        outs = llm.generate(PROMPTS, params)
        expected = eager.generate(PROMPTS, params)
        assert [o.text for o in outs] == [o.text for o in expected]
        for out in outs[::2]:
            jsonschema.validate(json.loads(out.text), SCHEMA)
    finally:
        llm.engine.shutdown()


OPEN_OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    # properties other than "a" are allowed: it does not say otherwise
    "required": ["a"],
}


@pytest.mark.parametrize("strict", [True, False])
def test_strict_decides_whether_a_schema_admits_properties_it_does_not_name(
    eager: LLM, strict: bool
) -> None:
    """Strict closes the object after "a"; not strict, the random model opens another property,
    which the schema allows (JSON Schema's additionalProperties defaults to true)."""
    spec = StructuredOutput("json", json.dumps(OPEN_OBJECT), strict)
    out = eager.generate("x", SamplingParams(max_tokens=48, temperature=0, structured=spec))[0]
    if strict:
        assert out.finish_reason == "stop" and list(json.loads(out.text)) == ["a"]
    else:
        assert re.match(r'\{"a": \d, "', out.text), out.text


def test_a_schema_is_strict_by_default() -> None:
    assert StructuredOutput("json", "{}").strict, "offline, as vLLM and SGLang compile every schema"
    with pytest.raises(ValueError, match="strict must be a boolean"):
        StructuredOutput("json", "{}", strict="yes").validate()


@pytest.mark.parametrize("max_tokens", [8, 1], ids=["midway", "last token"])
def test_a_rejected_token_fails_its_request_only(eager: LLM, max_tokens: int) -> None:
    """logit_bias rules out every token the constraint allows: the token drawn breaks the
    constraint, so the request fails (finish_reason "error", the token not emitted) instead of
    ending with "stop" (or "length", when it was the last token)."""
    choice = StructuredOutput("choice", ("apple", "banana"))
    vocab = eager.engine.scheduler.config.vocab_size
    doomed = SamplingParams(max_tokens=max_tokens, temperature=0, structured=choice,
                            logit_bias={t: -math.inf for t in range(vocab)})
    fine = SamplingParams(max_tokens=8, temperature=0, structured=choice)
    outs = eager.generate(PROMPTS[:3], [fine, doomed, fine])
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == [] and failed.text == ""
    assert "choice constraint does not allow" in failed.error
    alone = eager.generate([PROMPTS[0], PROMPTS[2]], fine)
    assert [outs[0].text, outs[2].text] == [o.text for o in alone] and outs[0].text in choice.spec
    assert outs[0].finish_reason == outs[2].finish_reason == "stop"
    eager.engine.scheduler.check_integrity()


def test_a_constraint_no_token_can_continue_fails_its_request_only(eager: LLM) -> None:
    """The pattern needs a raw control character, which JSON output never holds (the JSON mask drops
    those tokens): after '"a' nothing is allowed. The request fails there; it does not go on
    unconstrained."""
    stuck = StructuredOutput("json", json.dumps({"type": "string", "pattern": "^a\u0001b$"}))
    fine = SamplingParams(max_tokens=128, temperature=0, structured=JSON)
    outs = eager.generate(
        PROMPTS[:3], [fine, SamplingParams(max_tokens=16, temperature=0, structured=stuck), fine]
    )
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.text == '"a', failed
    assert "allows no next token" in failed.error
    for out in (outs[0], outs[2]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    eager.engine.scheduler.check_integrity()


def test_a_user_stop_token_can_end_a_complete_document(eager: LLM) -> None:
    """The request's own stop_token_ids are allowed where the EOS is (the document may end), as in
    vLLM, never inside it (the output still parses)."""
    stop = eager.tokenizer.encode("z", add_special_tokens=False)[0]
    choice = StructuredOutput("choice", ("ab", "abc"))
    out = eager.generate(
        "x",
        SamplingParams(
            max_tokens=16,
            temperature=0,
            stop_token_ids=(stop,),
            logit_bias={stop: 50.0},
            structured=choice,
        ),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert out.text == "abz", (
        "the document, then the stop token (whose text stays, as any stop token's)"
    )


def test_a_stop_token_outside_the_vocabulary_is_a_clear_error(eager: LLM) -> None:
    """Rejected by the request check naming it (it once crashed building the constraint's stop
    mask)."""
    choice = StructuredOutput("choice", ("ab", "abc"))
    with pytest.raises(ValueError, match="stop_token_ids"):
        eager.generate(
            "x", SamplingParams(max_tokens=4, stop_token_ids=(10**6,), structured=choice)
        )
    assert eager.generate("x", SamplingParams(max_tokens=4, structured=choice))[0].outputs[
        0
    ].text in ("ab", "abc")
