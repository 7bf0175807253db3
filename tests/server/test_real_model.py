"""The built-in real model over HTTP with the official `openai` client, compiled as `serve` runs it by default
(the engine settings of the parity tests, so that a suite run compiles them once)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.parity.test_parity_matrix import ENGINE
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
# Greedy, and no near tie in transformers fp32 over its first 32 steps (top-2 gaps >= 0.128): bf16 answers the same.
CPU_ANSWER = "A CPU (Central Processing Unit) is the brain of a computer that executes instructions and performs " \
             "calculations."


def test_smollm2_answers_over_http() -> None:
    running = start_server(start_timeout_s=900, engine=dict(model="smollm2", enforce_eager=False) | ENGINE)
    try:
        client = OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Explain in one sentence what a CPU does."}],
            max_tokens=32, temperature=0)
        assert out.choices[0].message.content.startswith(CPU_ANSWER), out.choices[0].message.content
        chunks = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Explain in one sentence what a CPU does."}],
            max_tokens=32, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == out.choices[0].message.content
        _weather_tool_round(client)
    finally:
        running.stop()


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


def _weather_tool_round(client: OpenAI) -> None:
    """A weather-tool prompt with tool_choice auto is served end to end: an answer in words or a call whose
    arguments parse; with `required` it is always a call."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    auto = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER_TOOL], tool_choice="auto",
                                          max_tokens=48, temperature=0).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    for call in auto.message.tool_calls or []:
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert auto.message.tool_calls or auto.message.content
    forced = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER_TOOL],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                            temperature=0).choices[0]
    assert forced.finish_reason == "tool_calls"
    (call,) = forced.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
