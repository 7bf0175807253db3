"""Memory a request can make the server hold is bounded: an answer that could hold more log-probs
than the limit is a 400 up front, and the Responses store is bounded in bytes as well as in
count."""

from __future__ import annotations

import pytest

from compiled_engine.sampling_params import SamplingParams
from server.generation import MAX_LOGPROB_ENTRIES, check_answer_size
from server.request_errors import ProtocolError
from server.response_store import ResponseStore, Stored


def test_an_answer_beyond_the_logprob_limit_is_a_400() -> None:
    prompts = [list(range(2000))] * 64
    many = [SamplingParams(max_tokens=1, prompt_logprobs=20)] * 64  # 64 x 2000 x 21
    with pytest.raises(ProtocolError, match=f"more than the server's limit of "
                                             f"{MAX_LOGPROB_ENTRIES:,}") as caught:
        check_answer_size(prompts, many)
    assert caught.value.status == 400 and caught.value.param == "prompt_logprobs"
    with pytest.raises(ProtocolError) as caught:
        check_answer_size([[1]], [SamplingParams(max_tokens=4096, logprobs=20, n=16)])
    assert caught.value.param == "logprobs"
    check_answer_size(prompts[:8], many[:8])  # 336,000: within the limit
    check_answer_size(prompts, [SamplingParams(max_tokens=4096)] * 64)  # no log-probs asked


def test_the_response_store_is_bounded_in_bytes() -> None:
    store = ResponseStore(capacity=100, capacity_bytes=10_000)
    message = Stored([{"role": "assistant", "content": "x" * 1000}], {"id": "r"}, [], "")
    for i in range(30):
        store.put(f"r{i}", message)
    assert store.nbytes <= 10_000
    with pytest.raises(ProtocolError) as gone:
        store.get("r0", "")
    assert gone.value.status == 404
    assert store.get("r29", "") == message
    huge = Stored([{"role": "assistant", "content": "x" * 20_000}], {}, [], "")  # over the bound
    store.put("huge", huge)
    with pytest.raises(ProtocolError):
        store.get("huge", "")
    assert store.get("r29", "") == message and store.nbytes <= 10_000
    assert store.delete("r29") and not store.delete("r29")
