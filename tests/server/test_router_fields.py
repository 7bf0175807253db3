"""What the field's routers send and read (captured from sglang-router 0.3.2 and vllm-router 0.1.17
forwarding to a recording server): every field they add to a request is accepted where it asks for
what the server does anyway and answers the same as without it; a value asking for anything else is
a 400 naming the field; the info and load endpoints they poll answer, sharing the engine's round
trips; /metrics also carries vLLM's names."""

from __future__ import annotations

import asyncio

import httpx
import pytest

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "temperature": 0}
COMPLETION = {"model": "demo", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
NATIVE = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
# what each router adds, as captured
SGLANG_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
VLLM_CHAT = SGLANG_CHAT | {"include_reasoning": True}
COMPLETION_EXTRA = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                    "skip_special_tokens": True, "return_hidden_states": False}
SGLANG_NATIVE = {"model": None, "return_text_in_logprobs": False, "stream": False,
                 "log_metrics": True, "return_hidden_states": False, "background": False,
                 "no_logs": False, "return_bytes": False, "return_entropy": False}
VLLM_NATIVE = {"stream": False, "return_logprob": False, "return_hidden_states": False}


def _answer(http: httpx.Client, path: str, body: dict) -> object:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/generate":
        return out["text"], out["output_ids"]
    choice = out["choices"][0]
    return choice.get("text") or choice["message"]["content"], choice["finish_reason"]


@pytest.mark.parametrize("path, body, extra", [
    ("/v1/chat/completions", CHAT, SGLANG_CHAT),
    ("/v1/chat/completions", CHAT, VLLM_CHAT),
    ("/v1/completions", COMPLETION, COMPLETION_EXTRA),
    ("/generate", NATIVE, SGLANG_NATIVE),
    ("/generate", NATIVE, VLLM_NATIVE),
])
def test_router_fields_are_accepted_and_change_nothing(http, path, body, extra) -> None:
    assert _answer(http, path, body | extra) == _answer(http, path, body)


@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/chat/completions", CHAT, "continue_final_message", True),
    ("/v1/chat/completions", CHAT, "return_hidden_states", True),
    ("/v1/completions", COMPLETION, "return_hidden_states", True),
    ("/generate", NATIVE, "return_hidden_states", True),
    ("/generate", NATIVE, "return_logprob", True),
    ("/generate", NATIVE, "log_metrics", False),
    ("/generate", NATIVE, "background", True),
    ("/v1/chat/completions", CHAT, "separate_reasoning", "yes"),
    ("/v1/chat/completions", CHAT, "skip_special_tokens", False),
    ("/v1/completions", COMPLETION, "return_hidden_states", 0),
    ("/v1/completions", COMPLETION, "continue_final_message", False),
    ("/tokenize", {"messages": CHAT["messages"]}, "continue_final_message", True),
])
def test_a_router_field_asking_for_more_is_a_400(http, path, body, field, value) -> None:
    r = http.post(path, json=body | {field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_return_text_in_logprobs_with_logprobs_is_a_400(http) -> None:
    body = NATIVE | {"return_text_in_logprobs": True}
    assert http.post("/generate", json=body).status_code == 200  # no logprobs: nothing asked
    body["sampling_params"] = NATIVE["sampling_params"] | {"logprobs": 1}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_text_in_logprobs"


def test_no_stop_trim_on_chat_and_generate(http) -> None:
    """The matched stop string stays in the text (SGLang's `no_stop_trim`), on chat and in
    `/generate`'s sampling_params; without it, it is cut."""
    full = _answer(http, "/v1/chat/completions", CHAT | {"max_tokens": 16})[0]
    stop = full[4:7]
    assert stop.strip(), full
    kept = full[: full.index(stop) + len(stop)]
    for no_trim, want in ((True, kept), (False, full[: full.index(stop)])):
        body = CHAT | {"max_tokens": 16, "stop": [stop], "no_stop_trim": no_trim}
        assert _answer(http, "/v1/chat/completions", body) == (want, "stop")
    text = _answer(http, "/generate", {"text": "Hello", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0}})[0]
    stop = text[4:7]
    sp = {"max_new_tokens": 16, "temperature": 0, "stop": [stop], "no_stop_trim": True}
    got = _answer(http, "/generate", {"text": "Hello", "sampling_params": sp})[0]
    assert got == text[: text.index(stop) + len(stop)]


def test_tokenize_as_vllm_router_asks(http) -> None:
    """vllm-router renders a prompt through /tokenize for cache-aware routing."""
    chat = http.post("/tokenize", json={"model": "demo", "continue_final_message": False,
                                        "messages": CHAT["messages"]})
    assert chat.status_code == 200 and chat.json()["tokens"]
    plain = http.post("/tokenize", json={"model": "demo", "prompt": "Hello"})
    assert plain.status_code == 200 and plain.json()["tokens"]


def test_info_and_load_endpoints(http) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["model_path"] == "demo" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["tp_size"] == 1 and info["max_running_requests"] > 0 and info["version"]
    load = http.get("/get_load").json()
    assert set(load) == {"load"} and isinstance(load["load"], int) and load["load"] >= 0


def test_polls_of_info_and_load_share_the_engine_round_trips(server, monkeypatch) -> None:
    """64 concurrent polls of /get_load and /server_info: /get_load is answered from the server's
    books, /server_info's engine stats are shared (one round trip per STATS_MAX_AGE_S, set past the
    test's length here so that the count does not depend on the machine's speed)."""
    from server import info_routes

    monkeypatch.setattr(info_routes, "STATS_MAX_AGE_S", 3600.0)  # (imported from server.routes)
    client = server.state.client
    before = client.round_trips

    async def poll() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(http.get(path) for path in
                                          ("/get_load", "/server_info") * 32))

    replies = asyncio.run(poll())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert all(isinstance(r.json().get("load", 0), int) for r in replies)
    assert client.round_trips - before <= 1


def test_metrics_under_vllm_names(http) -> None:
    http.post("/v1/completions", json=COMPLETION)
    text = http.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("vllm:")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in values, name
    assert values["vllm:prefix_cache_queries_total"] > 0
    assert 0 <= values["vllm:prefix_cache_hits_total"] <= values["vllm:prefix_cache_queries_total"]
    assert values["vllm:num_requests_running"] >= 0 and values["vllm:num_requests_waiting"] >= 0
    assert 0.0 <= values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"] <= 1.0
