"""`serve --no-deterministic` (oneDNN / BLAS GEMMs, split attention), compiled as it starts by
default, with overlap on and a KV pool small enough to retract: concurrent HTTP requests get
transformers' greedy tokens, and the ledger ends whole."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from compiled_engine.models.demo import demo_model_dir
from tests.distributed.conftest import hf_greedy, ragged_prompts
from tests.helpers.servers import RunningServer, assert_kv_all_free, start_server, wait_idle

NEW_TOKENS = 10
PROMPTS = ragged_prompts(16, vocab=8000)


@pytest.fixture(scope="module")
def fast_server() -> Iterator[RunningServer]:
    running = start_server(
        debug=True,
        engine={"deterministic": False, "overlap": True, "num_pages": 160, "max_running": 16},
    )
    yield running
    running.stop()


def test_concurrent_greedy_requests_equal_transformers_through_retraction(
    fast_server: RunningServer,
) -> None:
    body = {"sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    with fast_server.http() as http, ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(
            pool.map(lambda p: http.post("/generate", json=body | {"input_ids": p}), PROMPTS)
        )
        assert [r.status_code for r in replies] == [200] * len(PROMPTS)
        assert [r.json()["output_ids"] for r in replies] == hf_greedy(
            str(demo_model_dir()), PROMPTS, NEW_TOKENS
        )
        stats = wait_idle(http)
    assert_kv_all_free(stats)
    assert stats["num_retractions"] > 0, "the small pool should have forced a retraction"
