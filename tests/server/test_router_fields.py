"""What the field's routers send and read (captured from sglang-router 0.3.2 and vllm-router 0.1.17
forwarding to a recording server): every field they add to a request is accepted where it asks for
what the server does anyway and answers the same as without it; a value asking for anything else is
a 400 naming the field; the info and load endpoints they poll answer; /metrics also carries vLLM's
names."""

from __future__ import annotations

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
])
def test_a_router_field_asking_for_more_is_a_400(http, path, body, field, value) -> None:
    r = http.post(path, json=body | {field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


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


def test_metrics_under_vllm_names(http) -> None:
    http.post("/v1/completions", json=COMPLETION)
    text = http.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("vllm:")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in values, name
    assert values["vllm:prefix_cache_queries_total"] > 0
    assert 0.0 <= values["vllm:gpu_cache_usage_perc"] <= 1.0
