"""The process that compiles output constraints for the server's check (server/grammar_check.py):
the same compile as the engine's ranks (`GrammarBook`), in a process that can be killed when it runs
past its budget. torch and xgrammar are imported here, never in the server's process."""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import Connection

from compiled_engine.sampling_params import StructuredOutput

READY = "ready"


def serve_compiles(conn: Connection, model_path: str, vocab_size: int,
                   stop_token_ids: Sequence[int]) -> None:
    """Send READY once loaded, then answer each StructuredOutput received with None (it compiles)
    or the ConstraintError's message; return when the other end closes."""
    from compiled_engine.constraints import ConstraintError, GrammarBook
    from compiled_engine.tokenization import load_tokenizer

    book = GrammarBook(lambda: load_tokenizer(model_path), vocab_size, stop_token_ids,
                       cache_bytes=0)
    book.compile(StructuredOutput("regex", "a"))  # the tokenizer and xgrammar, before any budget
    conn.send(READY)
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            book.compile(spec)
            conn.send(None)
        except ConstraintError as e:
            conn.send(str(e))
