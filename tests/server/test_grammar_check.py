"""The server's constraint check (server/grammar_check.py) on the demo checkpoint's tokenizer: a
constraint that compiles passes, a bad one is a 400 naming its field with the compiler's reason, one
that runs past the budget is a 400 naming the flag, one that runs the worker out of memory is a 400
naming the limit (the worker restarts), and verdicts come from the cache the second time (no compile
sent to the worker); the worker's CPU backstop ends it."""

from __future__ import annotations

import asyncio
import signal

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


# a grammar whose compile allocates far more than its text (quadratic in the optional items)
MEMORY_BOMB = StructuredOutput("grammar", "root ::= " + " ".join(["[a-z]?"] * 12000))


@pytest.fixture(scope="module")
def small_checker():
    """A worker allowed 256 MiB per compile, and a budget no compile here comes near (the verdicts
    below are memory's, whatever the machine's load)."""
    from compiled_engine.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(demo_model_dir()))
    made = GrammarChecker(str(demo_model_dir()), len(tokenizer), [tokenizer.eos_token_id], 600.0,
                          memory_bytes=256 << 20)
    yield made
    made.close()


def test_a_constraint_past_the_memory_limit_is_a_remembered_400(small_checker) -> None:
    checker = small_checker
    assert _verdict(checker, StructuredOutput("regex", "[0-9]+"), "x") is None
    starts, compiles = checker.starts, checker.compiles
    error = _verdict(checker, MEMORY_BOMB, "structured_outputs.grammar")
    assert error is not None and error.status == 400
    assert error.param == "structured_outputs.grammar"
    assert "256 MiB" in error.message and "--grammar-compile-memory" in error.message
    again = _verdict(checker, MEMORY_BOMB, "structured_outputs.grammar")
    assert again is not None and again.message == error.message
    assert (checker.starts, checker.compiles) == (starts, compiles + 1)  # remembered: no worker
    # a fresh worker serves the next constraint
    assert _verdict(checker, StructuredOutput("choice", ("yes", "no")), "x") is None
    assert checker.starts == starts + 1


def test_the_worker_ends_itself_past_its_cpu_backstop() -> None:
    """The worker's own CPU limit per compile (SIGXCPU), behind the server's wall-clock budget
    (memory set far past what the compile takes, so that CPU is what ends it)."""
    import multiprocessing

    from compiled_engine.grammar_worker import READY, serve_compiles
    from compiled_engine.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(demo_model_dir()))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=serve_compiles, daemon=True, args=(
        theirs, str(demo_model_dir()), len(tokenizer), [tokenizer.eos_token_id], 8 << 30, 1.0))
    worker.start()
    theirs.close()
    try:
        assert ours.poll(300) and ours.recv() == READY
        # 40,000 properties: a compile of far more than the 1 s budget on any CPU
        ours.send(StructuredOutput("json", slow_schema(40000, "cpu")))
        assert ours.poll(300), "the worker neither answered nor ended"
        with pytest.raises(EOFError):
            ours.recv()
        worker.join(30)
        assert worker.exitcode == -signal.SIGXCPU
    finally:
        worker.kill()
        worker.join(10)
