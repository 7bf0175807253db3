"""Hypothesis fuzzes request bodies: every answer is 200 or a 4xx in the error shape, never a 5xx,
and the server keeps serving (and its ledger stays consistent) afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.servers import assert_kv_all_free, wait_idle

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
JSON = {"content-type": "application/json"}
token_list = st.lists(st.integers(min_value=-5, max_value=9000), max_size=6)
# any code point, lone surrogates included (json.dumps escapes them as \udXXX: valid JSON, invalid
# text)
lone_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
unicode_text = st.text(max_size=20) | st.text(
    st.characters() | lone_surrogate, min_size=1, max_size=8
)

# Mostly valid values (a few out of range), so that many bodies reach the engine ...
valid = {
    "model": st.just("demo"),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 10),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**65), 2**65),
    "n": st.integers(0, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": token_list,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 2),
    "logit_bias": st.dictionaries(st.integers(-2, 9000).map(str), st.floats(-150, 150), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 3),
}
max_tokens = st.integers(min_value=-1, max_value=4)  # always present: keeps generations short
# ... and at most one field replaced by junk of any type (huge numbers, unicode, nested containers).
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def bodies(required: dict, optional: dict) -> st.SearchStrategy:
    keys = sorted(required | optional)

    def corrupt(body: dict, spoil: tuple[str, object] | None) -> dict:
        return body if spoil is None else body | {spoil[0]: spoil[1]}

    return st.builds(corrupt, st.fixed_dictionaries(required, optional=optional),
                     st.none() | st.tuples(st.sampled_from(keys), junk))


completion_body = bodies(
    {"max_tokens": max_tokens,
     "prompt": unicode_text | token_list | st.lists(st.text(max_size=8), min_size=1, max_size=2)},
    valid | {"logprobs": st.integers(-1, 5), "echo": st.booleans()},
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": unicode_text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": unicode_text}), max_size=2
        ),
    }
)
chat_body = bodies(
    {"max_tokens": max_tokens, "messages": st.lists(message, max_size=3)},
    valid | {"logprobs": st.booleans(), "top_logprobs": st.integers(-1, 5)},
)


def _check(r: httpx.Response) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        for line in r.text.split("\n\n")[:-2]:
            assert "error" not in json.loads(line.removeprefix("data: ")), line
    else:
        assert r.json()["choices"]


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(http: httpx.Client, body: dict) -> None:
    _check(http.post("/v1/completions", content=json.dumps(body), headers=JSON))


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(http: httpx.Client, body: dict) -> None:
    _check(http.post("/v1/chat/completions", content=json.dumps(body), headers=JSON))


# JSON schemas as users write them, odd ones included: patterns (some not RE2's), local and remote
# $refs (some recursive), nesting, keywords of every draft
schema = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "string", "integer", "array", "null", "nonsense"]),
        "pattern": st.sampled_from(["^a+$", "(a+)+$", "(x)\\1", "(?=a)", "[", "\\d{2,3}"]),
        "enum": st.lists(st.integers(0, 3) | st.text(max_size=3), max_size=3),
        "maxLength": st.integers(-1, 5),
        "$ref": st.sampled_from(["#", "#/properties/a", "#/$defs/x", "#/nowhere", "http://x/s"]),
    }),
    lambda children: st.fixed_dictionaries({}, optional={
        "type": st.just("object"),
        "properties": st.dictionaries(st.sampled_from(["a", "b", "x"]), children, max_size=2),
        "patternProperties": st.dictionaries(st.sampled_from(["^a", "(b+)+", "(?!c)"]), children,
                                             max_size=1),
        "additionalProperties": st.booleans() | children,
        "items": children,
        "anyOf": st.lists(children, max_size=2),
        "$defs": st.fixed_dictionaries({"x": children}),
        "required": st.lists(st.sampled_from(["a", "b"]), max_size=2),
    }),
    max_leaves=8,
)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_x", "bad name"]), "parameters": schema | junk},
    optional={"strict": st.booleans()})})
tools_body = bodies(
    {"max_tokens": max_tokens, "messages": st.lists(message, min_size=1, max_size=2)},
    {"tools": st.lists(tool, max_size=2),
     "tool_choice": st.sampled_from(["auto", "required", "none"]),
     "response_format": st.fixed_dictionaries({
         "type": st.just("json_schema"),
         "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": schema},
                                              optional={"strict": st.booleans()})}),
     "structured_outputs": st.fixed_dictionaries({}, optional={
         "regex": st.sampled_from(["[a-c]{1,3}", "(a)\\1", "("]), "choice": st.lists(
             st.text(max_size=4), max_size=2)})},
)
OTHER_ROUTES = {
    "/v1/responses": bodies({"max_output_tokens": max_tokens, "input": unicode_text},
                            {"instructions": unicode_text, "temperature": st.floats(0, 2),
                             "stream": st.booleans(), "store": st.booleans(),
                             "previous_response_id": st.text(max_size=8),
                             "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({
                                 "type": st.just("json_schema"), "name": st.just("x"),
                                 "schema": schema})})}),
    "/v1/embeddings": bodies({"input": unicode_text | token_list | st.lists(unicode_text,
                                                                             max_size=2)},
                             {"model": st.just("demo"), "encoding_format": st.sampled_from(
                                 ["float", "base64", "hex"]), "dimensions": st.integers(-1, 70)}),
    "/generate": bodies({"text": unicode_text},
                        {"input_ids": token_list, "stream": st.booleans(),
                         "sampling_params": st.fixed_dictionaries({"max_new_tokens": max_tokens},
                                                                  optional={
                             "json_schema": schema.map(json.dumps),
                             "regex": st.sampled_from(["[0-9]+", "(a)\\1"]),
                             "temperature": st.floats(0, 2)})}),
    "/tokenize": bodies({}, {"prompt": unicode_text, "messages": st.lists(message, max_size=2),
                             "add_special_tokens": st.booleans()}),
    "/detokenize": bodies({"tokens": token_list}, {"model": st.just("demo")}),
}


@FUZZ
@given(body=tools_body)
def test_fuzz_tools_and_schemas(http: httpx.Client, body: dict) -> None:
    """Tools, response formats and structured outputs with any schema: never a 5xx."""
    _check(http.post("/v1/chat/completions", content=json.dumps(body), headers=JSON))


@FUZZ
@given(data=st.data(), route=st.sampled_from(sorted(OTHER_ROUTES)))
def test_fuzz_every_other_route(http: httpx.Client, data, route: str) -> None:
    """Every other POST route (and the GET info routes after each): a 200 or a 4xx in OpenAI's
    error shape, never a 5xx."""
    r = http.post(route, content=json.dumps(data.draw(OTHER_ROUTES[route])), headers=JSON)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (route, r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", err
    for info in ("/v1/models", "/server_info", "/model_info", "/get_load"):
        assert http.get(info).status_code == 200, info


def test_still_serving_after_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    out = http.post(
        "/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True}
    ).json()
    assert out["usage"]["completion_tokens"] == 2
    assert_kv_all_free(wait_idle(http))
