"""Tool calling through the official openai client on the demo model: `required` and a named
function are constrained by the functions' schemas, so the calls always parse and validate; streamed
calls reassemble into the same calls; tool results go back through the chat template; bad tools are
400s naming the field. The model-family parsers of `auto` are tested on their formats directly."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server.tools import ToolRequest, extract_calls, parse_tool_request, parser_for_template

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("parallel", [True, False])
def test_required_yields_calls_that_validate(client: openai.OpenAI, parallel: bool) -> None:
    out = client.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=400,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _check_calls(choice.message.tool_calls)
    assert calls and (parallel or len(calls) == 1)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        max_tokens=200,
        temperature=0.9,
        seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in _check_calls(out.choices[0].message.tool_calls)] == ["get_time"]


def test_streamed_calls_reassemble_into_the_same_calls(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=400,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]


def test_a_tool_result_round_trip(client: openai.OpenAI, server) -> None:
    first = (
        client.chat.completions.create(
            model="demo",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    out = client.chat.completions.create(
        model="demo", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content is not None and out.choices[0].message.tool_calls is None
    # the template saw the call and the result: the prompt grew by both
    with server.http() as http:
        plain = http.post(
            "/v1/chat/completions", json={"model": "demo", "messages": ASK, "max_tokens": 1}
        ).json()
        longer = http.post(
            "/v1/chat/completions",
            json={"model": "demo", "messages": history, "max_tokens": 1, "tools": TOOLS},
        ).json()
    assert longer["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(server, body: dict, param: str) -> None:
    with server.http() as http:
        r = http.post(
            "/v1/chat/completions", json={"model": "demo", "messages": ASK, "max_tokens": 4} | body
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        assert (
            http.post(
                "/v1/completions", json={"model": "demo", "prompt": "ok", "max_tokens": 2}
            ).status_code
            == 200
        )


def _auto() -> ToolRequest:
    return parse_tool_request({"tools": TOOLS})


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            "hermes",
            'Let me look.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            "Let me look.",
            [("get_time", {"zone": "UTC"})],
        ),
        (
            "hermes",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", "
            "\"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", "
            "\"arguments\": {\"zone\": \"CET\"}}</tool_call>",
            None,
            [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})],
        ),
        ("hermes", "No tools needed.", "No tools needed.", []),
        (
            "hermes",
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
            [],
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
            None,
            [("get_time", {"zone": "UTC"})],
        ),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            None,
            [("get_time", {"zone": "UTC"})],
        ),
        (
            "mistral",
            'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            "Sure.",
            [("get_time", {"zone": "UTC"})],
        ),
    ],
)
def test_auto_parsers(parser: str, text: str, content, calls) -> None:
    got_content, got = extract_calls(_auto(), text, parser)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_parser_follows_the_chat_template() -> None:
    assert parser_for_template("{% for m in messages %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
