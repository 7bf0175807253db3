"""Raw HTTP: SSE framing, the native endpoints, health, metrics, and every 400."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.servers import assert_kv_all_free, sse_events, wait_idle


def _stream(http: httpx.Client, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_sse_framing_and_usage_chunk(http: httpx.Client) -> None:
    events = _stream(
        http,
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all("usage" not in c for c in chunks[:-1])


def test_chat_sse_without_usage(http: httpx.Client) -> None:
    events = _stream(
        http,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "yo"}],
            "max_tokens": 3,
            "stream": True,
            "ignore_eos": True,
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_zero_produces_no_token(http: httpx.Client) -> None:
    out = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 0}).json()
    assert out["choices"][0]["text"] == "" and out["usage"]["completion_tokens"] == 0
    assert out["choices"][0]["finish_reason"] == "length"


def test_echo(http: httpx.Client) -> None:
    plain = http.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    ).json()
    echo = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                              "echo": True}).json()
    assert echo["choices"][0]["text"] == "Hello" + plain["choices"][0]["text"]


def test_sampling_fields_are_applied(http: httpx.Client) -> None:
    def text(**extra) -> str:
        body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True} | extra
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    base = text()
    ids = http.post(
        "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
    ).json()["output_ids"]
    # a huge bias on the first greedy token of another run forces it everywhere
    forced = text(logit_bias={str(ids[1]): 100})
    assert forced != base
    text(
        repetition_penalty=1.5,
        presence_penalty=1.0,
        frequency_penalty=1.0,
        min_p=0.1,
        top_p=0.9,
        temperature=0.7,
    )
    assert text(top_k=1, temperature=1.0, seed=3) == base  # top_k 1 is greedy
    stopped = http.post(
        "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 6, "temperature": 0, "stop_token_ids": [ids[2]]},
    ).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"


def test_native_generate_and_tokenizers(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids[1:]}).json()["text"] == "Hello world"
    a = http.post(
        "/generate",
        json={"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    ).json()
    b = http.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 0}}
    ).json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 5
    assert a["text"] == http.post("/detokenize", json={"tokens": a["output_ids"]}).json()["text"]
    events = _stream(http, "/generate", {"input_ids": ids, "stream": True,
                                         "sampling_params": {"max_tokens": 5, "temperature": 0}})
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for c in chunks for t in c["output_ids"]] == a["output_ids"]
    chat = http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()["tokens"]
    # one BOS: the chat template adds it, the tokenizer does not add another
    assert chat.count(1) == 1


def test_health_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in (
        "compiled_engine_requests_total",
        "compiled_engine_prompt_tokens_total",
        "compiled_engine_generation_tokens_total",
        "compiled_engine_num_requests_waiting",
        "compiled_engine_num_requests_running",
        "compiled_engine_kv_cache_usage",
        "compiled_engine_prefix_cache_hit_rate",
        "compiled_engine_time_to_first_token_seconds_bucket",
        "compiled_engine_time_per_output_token_seconds_bucket",
        "compiled_engine_e2e_request_latency_seconds",
    ):
        assert name in text, name
    assert 'compiled_engine_requests_total{endpoint="completions",status="200"}' in text


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


LONG = "hello " * 3000


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
        ("/v1/completions", {"prompt": LONG}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": 1e400}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": NaN}', "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 10**30}, "n"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "seed": "x"}, "seed"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/generate", {"sampling_params": {}}, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        # a lone UTF-16 surrogate in any text field (the JSON is valid; the text has no UTF-8 form)
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"]}', "prompt[1]"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["x", "\\ud800"]}', "stop[1]"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "user": "\\ud83d"}',
            "user",
        ),
        ("/generate", '{"text": "\\ud800", "sampling_params": {}}', "text"),
        ("/tokenize", '{"prompt": "\\udc00"}', "prompt"),
        # fields that are not implemented are rejected, never ignored
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object", "schema": {}},
            },
            "response_format.schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "audio": {}}]},
            "messages[0].audio",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
            "stream_options.continuous_usage_stats",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
            "reasoning_effort",
        ),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 3}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "guided_json"),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(a+"}}, "sampling_params.regex"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"ebnf": "root ::= x", "regex": "a"}},
            "sampling_params.ebnf",
        ),
        ("/generate", {"text": "hi", "return_logprob": True}, "return_logprob"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": False},
            "add_special_tokens",
        ),
    ],
)
def test_400_names_the_field(http: httpx.Client, path: str, body: dict | str, param: str) -> None:
    r = (http.post(path, content=body, headers={"content-type": "application/json"})
         if isinstance(body, str) else http.post(path, json=body))
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b"null", b"[" * 100000])
def test_malformed_bodies_are_400(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert _error(r)["type"] == "invalid_request_error"


def test_unset_optional_fields_are_accepted(http: httpx.Client) -> None:
    """null is absent (OpenAI clients may send it), and `user` asks for no behaviour."""
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "response_format": None,
        "tools": None,
        "user": "someone",
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing-here", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/generate", 405),
    ],
)
def test_unknown_paths_and_methods_answer_openai_errors(http: httpx.Client, method: str, path: str,
                                                        status: int) -> None:
    r = http.request(method, path)
    assert r.headers["content-type"].startswith("application/json")
    assert path in _error(r, status)["message"]
    if status == 405:
        assert "allow" in r.headers


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 2}}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_only_the_served_model_is_answered(http: httpx.Client, path: str, body: dict) -> None:
    err = _error(http.post(path, json=body | {"model": "gpt-4o"}), 404)
    assert (
        err["param"] == "model" and err["code"] == "model_not_found" and "gpt-4o" in err["message"]
    )
    served = http.get("/v1/models").json()["data"][0]["id"]
    ok = http.post(path, json=body | {"model": served})
    assert ok.status_code == 200, ok.text
    if path.startswith("/v1/"):
        assert ok.json()["model"] == served


def test_server_is_clean_after_errors(http: httpx.Client) -> None:
    assert_kv_all_free(wait_idle(http))
