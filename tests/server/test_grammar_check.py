"""The server's constraint check (server/grammar_check.py) on the demo checkpoint's tokenizer: a
constraint that compiles passes, a bad one is a 400 naming its field with the compiler's reason, one
that runs past the budget is a 400 naming the flag, and verdicts come from the cache the second time
(no compile sent to the worker)."""

from __future__ import annotations

import asyncio

import pytest

from compiled_engine.models.demo import demo_model_dir
from compiled_engine.sampling_params import StructuredOutput
from server.grammar_check import GrammarChecker
from server.request_errors import ProtocolError
from tests.helpers.servers import slow_schema


def _verdict(checker: GrammarChecker, spec: StructuredOutput, field: str) -> ProtocolError | None:
    try:
        asyncio.run(checker.check(spec, field))
    except ProtocolError as e:
        return e
    return None


@pytest.fixture(scope="module")
def checker():
    from compiled_engine.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(demo_model_dir()))
    made = GrammarChecker(str(demo_model_dir()), len(tokenizer), [tokenizer.eos_token_id], 1.0)
    yield made
    made.close()


def test_a_constraint_that_compiles_passes_once(checker: GrammarChecker) -> None:
    spec = StructuredOutput("regex", "[0-9]{3}-[a-z]+")
    assert _verdict(checker, spec, "structured_outputs.regex") is None
    compiles = checker.compiles
    assert _verdict(checker, spec, "structured_outputs.regex") is None
    assert checker.compiles == compiles  # the cache answered


def test_a_bad_constraint_is_a_400_naming_its_field(checker: GrammarChecker) -> None:
    error = _verdict(checker, StructuredOutput("grammar", "root ::= missing"),
                     "structured_outputs.grammar")
    assert error is not None and error.status == 400
    assert error.param == "structured_outputs.grammar" and "missing" in error.message


def test_a_compile_past_the_budget_is_a_400_and_the_worker_restarts(checker) -> None:
    slow = StructuredOutput("json", slow_schema(800, "budget"))
    error = _verdict(checker, slow, "response_format")
    assert error is not None and error.status == 400 and error.param == "response_format"
    assert "--grammar-compile-timeout" in error.message
    compiles = checker.compiles
    again = _verdict(checker, slow, "response_format")
    assert again is not None and again.message == error.message
    assert checker.compiles == compiles
    # the killed worker's successor compiles the next constraint
    assert _verdict(checker, StructuredOutput("choice", ("yes", "no")), "x") is None
    assert checker.compiles == compiles + 1
