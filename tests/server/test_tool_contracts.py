"""The contracts of tool calling an HTTP user relies on, on the demo model. A returned call always
names a function of the request and its arguments validate against that function's `parameters`
(with `strict`, objects that list properties are closed); any other output stays `content`.
`parallel_tool_calls: false` returns at most one call; a forced call cut by max_tokens ends with
`length`; streamed tool choices carry their logprobs. Under `auto` a `structured_outputs` choice
makes the random model write the exact text."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server.tools import extract_calls, parse_tool_request

TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _tools(strict: bool | None = None, time: dict = TIME) -> list[dict]:
    fn = {"name": "get_time", "parameters": time} | ({} if strict is None else {"strict": strict})
    return [{"type": "function", "function": fn},
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def _call_text(name: str, arguments: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _chat(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "demo", "messages": ASK, "max_tokens": 200,
                                                "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def _auto(http: httpx.Client, text: str, **body) -> dict:
    """The choice of an `auto` request whose output is exactly `text`."""
    return _chat(http, tools=_tools(), structured_outputs={"choice": [text]}, **body)["choices"][0]


def _events(http: httpx.Client, **body) -> list[dict]:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "demo", "messages": ASK, "max_tokens": 200, "temperature": 0, "stream": True}
        | body,
    ) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- 2: under auto, a call is returned only when its arguments validate --------------------------
@pytest.mark.parametrize(("arguments", "valid"), [
    ({"zone": "UTC"}, True),
    ({"zone": 1}, False),  # an integer for a string
    ({}, False),  # a required property missing
    ({"zone": "Europe/Paris"}, False),  # longer than maxLength
])
def test_auto_returns_a_call_only_when_its_arguments_validate(http: httpx.Client, arguments: dict,
                                                              valid: bool) -> None:
    text = _call_text("get_time", arguments)
    choice = _auto(http, text)
    if valid:
        assert choice["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == [("get_time", arguments)]
    else:
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == text and not choice["message"].get("tool_calls")


def test_auto_keeps_an_invalid_call_as_content_next_to_a_valid_one() -> None:
    req = parse_tool_request({"tools": _tools()})
    bad = _call_text("get_time", {"zone": 7})
    content, calls = extract_calls(
        req, "Checking. " + bad + _call_text("get_weather", {"city": "Oslo"}), "hermes"
    )
    assert content == "Checking. " + bad
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize(("parser", "text"), [
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": 7}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {"zone": 7}}]'),
    # args as JSON text
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": 7}"}</tool_call>'),
])
def test_every_parser_leaves_invalid_arguments_as_content(parser: str, text: str) -> None:
    assert extract_calls(parse_tool_request({"tools": _tools()}), text, parser) == (text, [])


# ---- 1: strict -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("strict", "valid"), [(None, True), (False, True), (True, False)])
def test_strict_closes_the_arguments_under_auto(
    http: httpx.Client, strict: bool | None, valid: bool
) -> None:
    text = _call_text("get_time", {"zone": "UTC", "note": "extra"})
    choice = _chat(http, tools=_tools(strict), structured_outputs={"choice": [text]})["choices"][0]
    assert choice["finish_reason"] == ("tool_calls" if valid else "stop")
    assert bool(choice["message"].get("tool_calls")) == valid


def test_strict_forced_calls_validate(http: httpx.Client) -> None:
    choice = _chat(http, tools=_tools(True), tool_choice=NAMED)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    assert set(args) == {"zone"} and isinstance(args["zone"], str) and len(args["zone"]) <= 5


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        (_tools("yes"), "tools[0].function.strict"),
        # constrained decoding does not enforce uniqueItems: strict cannot be honoured
        (
            _tools(
                True,
                {"type": "object", "properties": {"z": {"type": "array", "uniqueItems": True}}},
            ),
            "tools[0].function.strict",
        ),
        (
            _tools(True, {"type": "object", "properties": {"z": {"not": {"const": 1}}}}),
            "tools[0].function.strict",
        ),
        # the decoder reads an allOf of several schemas as any value, and drops constraints beside
        # anyOf or $ref
        (
            _tools(True, {"allOf": [{"type": "object"}, {"required": ["zone"]}]}),
            "tools[0].function.strict",
        ),
        (
            _tools(
                True,
                {
                    "type": "object",
                    "properties": {"z": {"anyOf": [{"type": "string"}], "maxLength": 2}},
                },
            ),
            "tools[0].function.strict",
        ),
        (
            _tools(None, {"type": "object", "properties": {"zone": {"type": "text"}}}),
            "tools[0].function.parameters",
        ),
    ],
)
def test_strict_that_cannot_be_honoured_is_a_400(
    http: httpx.Client, tools: list, param: str
) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": ASK, "max_tokens": 2, "tools": tools},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_strict_allows_what_the_decoder_enforces(http: httpx.Client) -> None:
    """Properties named like keywords, a $ref with a description, anyOf: accepted, and a forced call
    follows them."""
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string", "maxLength": 4},
            "if": {"$ref": "#/$defs/n", "description": "a number"},
        },
        "$defs": {
            "n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}
        },
        "required": ["if"],
    }
    choice = _chat(http, tools=_tools(True, schema), tool_choice=NAMED)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(args, schema | {"additionalProperties": False})


# ---- 3: parallel_tool_calls ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parallel", "names"),
    [
        (None, ["get_time", "get_weather"]),
        (True, ["get_time", "get_weather"]),
        (False, ["get_time"]),
    ],
)
def test_parallel_tool_calls_false_returns_one_call(http: httpx.Client, parallel: bool | None,
                                                    names: list[str]) -> None:
    text = _call_text("get_time", {"zone": "UTC"}) + _call_text("get_weather", {"city": "Oslo"})
    choice = _auto(http, text, parallel_tool_calls=parallel)
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
    assert choice["message"]["content"] is None


# ---- 4: a forced call cut by max_tokens ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_forced_call_cut_by_max_tokens_finishes_with_length(
    http: httpx.Client, tool_choice: object, stream: bool
) -> None:
    body = dict(tools=_tools(), tool_choice=tool_choice, max_tokens=2)
    if stream:
        last = [c for e in _events(http, **body) for c in e["choices"]][-1]
        finish, message = last["finish_reason"], last["delta"]
    else:
        choice = _chat(http, **body)["choices"][0]
        finish, message = choice["finish_reason"], choice["message"]
    assert finish == "length"
    assert not message.get("tool_calls") and message["content"]


# ---- 5: streamed tool choices carry logprobs -----------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_choices_carry_logprobs(http: httpx.Client, tool_choice: str) -> None:
    body = dict(
        tools=_tools(), tool_choice=tool_choice, logprobs=True, top_logprobs=2, max_tokens=24
    )
    whole = _chat(http, **body)
    expected = whole["choices"][0]["logprobs"]["content"]
    streamed = [lp for e in _events(http, **body) for c in e["choices"] if c["logprobs"] is not None
                for lp in c["logprobs"]["content"]]
    assert len(streamed) == len(expected) == whole["usage"]["completion_tokens"]
    assert [e["token"] for e in streamed] == [e["token"] for e in expected]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in expected], abs=1e-4
    )
    assert all(len(e["top_logprobs"]) == 2 for e in streamed)


def test_strict_closes_objects_as_constrained_decoding_does() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "prefixItems": [{"type": "integer"}]},
        },
    }
    lax, strict = (
        parse_tool_request({"tools": _tools(s, schema)}).functions[0] for s in (False, True)
    )
    for args in ({"a": {"b": 1, "x": 2}}, {"a": {}, "x": 1}, {"c": [1, 2]}):
        assert lax.accepts(args) and not strict.accepts(args)
    assert strict.accepts({"a": {"b": 1}, "c": [1]})


# ---- a schema's $ref is never fetched ------------------------------------------------------------
def test_a_remote_ref_is_a_400(http: httpx.Client) -> None:
    tools = _tools(
        None, {"type": "object", "properties": {"zone": {"$ref": "http://127.0.0.1:9/zone.json"}}}
    )
    r = http.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": ASK, "max_tokens": 2, "tools": tools},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[0].function.parameters"
    assert "nothing is fetched" in r.json()["error"]["message"]


def test_validating_arguments_fetches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a Function built past the request check: its unresolvable $ref rejects the call, without
    a fetch."""
    import urllib.request

    from server.tools import Function

    fetched = []

    def record(request, *args, **kwargs):
        fetched.append(getattr(request, "full_url", request))
        raise OSError("no network in this test")

    monkeypatch.setattr(urllib.request, "urlopen", record)
    fn = Function(
        "f", None, {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/a.json"}}}
    )
    assert not fn.accepts({"a": 1})
    assert fetched == []
