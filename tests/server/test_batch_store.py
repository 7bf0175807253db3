"""The Batch API's state on disk (server/batch/store.py) across a stop at the worst moments: a
line cut short while being written runs again, and a batch stopped while its answers were being
kept finishes keeping them (nothing answered twice, nothing lost)."""

import json

import pytest

from server.batch.store import BatchStore
from server.request_errors import ProtocolError


def answer(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200}}).encode()


def test_a_line_cut_short_and_what_follows_it_run_again(tmp_path) -> None:
    store = BatchStore(tmp_path)
    store.append_answer("batch_a", "output", answer("x"))
    store.append_answer("batch_a", "output", answer("y"))
    path = store.answers_path("batch_a", "output")
    path.write_bytes(path.read_bytes() + answer("z")[:9])  # the process stopped mid-line
    assert store.answered("batch_a") == {"output": {"x", "y"}, "errors": set()}
    assert path.read_bytes().count(b"\n") == 2 and path.read_bytes().endswith(b"\n")
    store.append_answer("batch_a", "output", answer("z"))
    assert store.answered("batch_a")["output"] == {"x", "y", "z"}


def test_keeping_the_answers_again_after_a_stop_finishes_the_move(tmp_path) -> None:
    store = BatchStore(tmp_path)
    store.append_answer("batch_a", "output", answer("x"))
    assert store.keep_answers("batch_a", "output", "file-out") == "file-out"
    assert store.keep_answers("batch_a", "output", "file-out") == "file-out"  # resumed: kept
    assert store.keep_answers("batch_a", "errors", "file-err") is None  # none to keep
    assert store.file("file-out")["purpose"] == "batch_output"
    assert store.file_path("file-out").read_bytes() == answer("x") + b"\n"


def test_ids_never_reach_outside_the_store(tmp_path) -> None:
    store = BatchStore(tmp_path)
    for bad in ("../x", "file-..", "a/b", "x" * 200):
        with pytest.raises(ProtocolError):
            store.file(bad)
