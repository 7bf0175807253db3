"""Hypothesis fuzzes request bodies: every answer is 200 or a 4xx in the error shape, never a 5xx,
and the server keeps serving (and its ledger stays consistent) afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import assert_kv_all_free, wait_idle

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


def test_still_serving_after_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    out = http.post(
        "/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True}
    ).json()
    assert out["usage"]["completion_tokens"] == 2
    assert_kv_all_free(wait_idle(http))
