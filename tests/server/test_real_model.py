"""The built-in real model over HTTP with the official `openai` client, compiled as `serve` runs it
by default (the engine settings of the parity tests, so that a suite run compiles them once)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from openai import OpenAI

from compiled_engine.models.names import resolve_model
from compiled_engine.tokenization import encode_chat, load_tokenizer
from tests.helpers.oracle import NEAR_TIE_GAP, hf_fp32_greedy
from tests.helpers.parity import ENGINE
from tests.helpers.servers import RunningServer, start_server

pytestmark = pytest.mark.slow
CPU_QUESTION = [{"role": "user", "content": "Explain in one sentence what a CPU does."}]
ANSWER_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[RunningServer]:
    running = start_server(
        start_timeout_s=900,
        max_queue=256,
        engine=dict(model="smollm2", enforce_eager=False, deterministic=True) | ENGINE,
    )
    yield running
    running.stop()


@dataclass
class Fp32Answer:
    """transformers fp32's greedy answer to CPU_QUESTION on the same file: the text after each
    token, and how far apart fp32's top two log-probs are at each step."""

    texts: list[str]
    gaps: list[float]
    ended: bool  # the answer's last text is complete (end of turn)

    def check(self, content: str) -> int:
        """Assert that `content` follows fp32's answer until it ends or parts at a near tie (where
        bf16 may pick the other token); returns the number of fp32 tokens it followed."""
        for k, text in enumerate(self.texts):
            if not content.startswith(text):
                assert self.gaps[k] < NEAR_TIE_GAP, (
                    f"our answer {content!r} parts from fp32's {text!r} at token "
                    f"{k}, where fp32's top two are {self.gaps[k]:.3f} apart"
                )
                return k
        assert not self.ended or content == self.texts[-1], (content, self.texts[-1])
        return len(self.texts)


@pytest.fixture(scope="module")
def fp32_answer() -> Fp32Answer:
    path = resolve_model("smollm2")
    tokenizer = load_tokenizer(path)
    (ref,) = hf_fp32_greedy(path, [encode_chat(tokenizer, CPU_QUESTION)], ANSWER_TOKENS)
    top2 = ref.logprobs.topk(2).values
    tokens = (
        ref.tokens[: ref.tokens.index(tokenizer.eos_token_id)]
        if tokenizer.eos_token_id in ref.tokens
        else ref.tokens
    )
    texts = [tokenizer.decode(tokens[:k + 1], skip_special_tokens=True) for k in range(len(tokens))]
    return Fp32Answer(texts, (top2[:, 0] - top2[:, 1]).tolist(), len(tokens) < len(ref.tokens))


def test_smollm2_answers_over_http(smollm2_server: RunningServer, fp32_answer: Fp32Answer) -> None:
    client = OpenAI(
        base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    out = client.chat.completions.create(
        model="smollm2", messages=CPU_QUESTION, max_tokens=ANSWER_TOKENS, temperature=0)
    followed = fp32_answer.check(out.choices[0].message.content)
    print(
        f"the answer follows transformers fp32 for {followed} of its {len(fp32_answer.texts)} "
        "tokens"
    )
    chunks = client.chat.completions.create(
        model="smollm2", messages=CPU_QUESTION, max_tokens=ANSWER_TOKENS, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
    _weather_tool_round(client)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


def _weather_tool_round(client: OpenAI) -> None:
    """A weather-tool prompt with tool_choice auto is served end to end: an answer in words or a
    call whose arguments parse; with `required` it is always a call."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    auto = client.chat.completions.create(
        model="smollm2",
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=48,
        temperature=0,
    ).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    for call in auto.message.tool_calls or []:
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert auto.message.tool_calls or auto.message.content
    forced = client.chat.completions.create(
        model="smollm2",
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
    ).choices[0]
    assert forced.finish_reason == "tool_calls"
    (call,) = forced.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]


# Deterministic inference (the default): what a user sees does not depend on what else the server is
# doing.
# transformers fp32: " a" -1.4836, " there" -1.4873
NEAR_TIE = "Once upon a time in a quiet village by the sea,"


def _complete(url: str, prompt: str, max_tokens: int, stream: bool = False) -> tuple[str, list]:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "stream": stream,
    }
    with httpx.Client(base_url=url, timeout=300) as http:
        if not stream:
            choice = http.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]
            return choice["text"], choice["logprobs"]["token_logprobs"]
        text, logprobs = "", []
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.raise_for_status().iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["text"]
                        logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        return text, logprobs


def _concurrently(fn, args: list[tuple]) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(lambda a: fn(*a), args))


def test_same_greedy_request_twice_gives_the_same_answer(smollm2_server: RunningServer) -> None:
    """The issue's report: the second request's prompt is a radix hit (all but its last token
    cached)."""
    first = _complete(smollm2_server.url, NEAR_TIE, 32)
    second = _complete(smollm2_server.url, NEAR_TIE, 32)
    assert first == second
    assert len(first[1]) == 32


def test_shared_prefix_prompts_concurrent_equal_sequential(smollm2_server: RunningServer) -> None:
    system = "You are a concise assistant. Answer in one short sentence. Question: "
    topics = [
        "rain",
        "the moon",
        "bread",
        "a violin",
        "glaciers",
        "bees",
        "copper",
        "tides",
        "owls",
        "salt",
        "volcanoes",
        "paper",
        "wind",
        "coral",
        "ink",
        "clocks",
    ]
    args = [(smollm2_server.url, f"{system}What is {t}? Answer:", 16) for t in topics]
    concurrent = _concurrently(_complete, args)
    sequential = [_complete(*a) for a in args]
    assert concurrent == sequential


def test_64_ragged_streams_equal_each_stream_alone(smollm2_server: RunningServer) -> None:
    words = [
        *NEAR_TIE.split(),
        "and",
        "the",
        "old",
        "lighthouse",
        "keeper",
        "watched",
        "the",
        "boats",
        "home",
    ]
    args = [
        (smollm2_server.url, " ".join(words[: 1 + i % len(words)]) + f" ({i})", 4 + i % 13, True)
        for i in range(64)
    ]
    together = _concurrently(_complete, args)
    alone = [_complete(*a) for a in args]
    assert together == alone
    assert all(0 < len(lp) <= a[2] for (_, lp), a in zip(alone, args))  # a stream may end at EOS
