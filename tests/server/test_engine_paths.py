"""What crosses the process boundary: greedy parity with the offline LLM, disconnects,
concurrency."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams
from tests.helpers.servers import ENGINE, assert_kv_all_free, wait_idle

PROMPTS = ["Hello world", "The capital of France is", "def fib(n):"]
# As many tokens as the demo model's context leaves a short prompt: a request cut short is told from
# a finished one by the steps it did not take, and the compiled demo model decodes fast.
LONG = 2000


@pytest.fixture(scope="module")
def llm() -> LLM:
    kwargs = {k: v for k, v in ENGINE.items() if k != "model"}
    return LLM(ENGINE["model"], **kwargs)


def test_greedy_http_equals_offline_llm(http: httpx.Client, llm: LLM) -> None:
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        out = http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        ).json()
        assert out["choices"][0]["text"] == expected.text
        native = http.post("/generate", json={"text": prompt, "sampling_params": {
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
        assert native["output_ids"] == expected.token_ids


def test_disconnect_mid_stream_aborts_and_frees_kv(server, http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {
        "prompt": "Tell me a long story",
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http() as other, other.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    after = wait_idle(http)
    assert after["steps"] - before["steps"] < LONG - 1, "the aborted request ran to its end"
    assert_kv_all_free(after)


def test_disconnect_of_a_plain_request_aborts_it(server, http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {"prompt": "Another long story", "max_tokens": LONG, "ignore_eos": True}
    with server.http() as other, pytest.raises(httpx.ReadTimeout):
        other.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    after = wait_idle(http)
    assert after["steps"] - before["steps"] < LONG - 1, "the aborted request ran to its end"
    assert_kv_all_free(after)


def test_64_concurrent_streams_complete_with_the_right_length(server, http: httpx.Client) -> None:
    max_tokens = 8

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, str]:
        body = {
            "prompt": f"Request number {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.8,
            "seed": i,
            "stream_options": {"include_usage": True},
        }
        usage, finish, text = None, None, ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
        return usage, finish, text

    async def main() -> list:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 180)

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 180
    assert [(u, f) for u, f, _ in results] == [(max_tokens, "length")] * 64
    assert_kv_all_free(wait_idle(http))
