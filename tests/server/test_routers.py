"""Two demo replicas behind each of the field's routers (sglang-router's `launch_router`,
vllm-router), cache-aware policy, all on loopback: chat, completions, streaming, `/generate`,
structured output and the official openai client answer through the router as a replica answers
directly."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from benchmarks.router import ROUTERS, running_router
from tests.helpers.servers import RunningServer, servers

pytestmark = pytest.mark.slow
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 12, "temperature": 0}
COMPLETION = {"model": "demo", "prompt": "The sky is", "max_tokens": 12, "temperature": 0}
NATIVE = {"text": "The sky is", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RunningServer]]:
    with servers({}, {}) as made:
        yield made


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def router(request, replicas, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    with running_router(request.param, "cache_aware", [r.url for r in replicas], log) as url:
        yield url


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(url: str, path: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


def test_answers_through_the_router_equal_a_replica(router, replicas) -> None:
    direct = replicas[0].url
    for path, body, pick in (
        ("/v1/chat/completions", CHAT, lambda o: o["choices"][0]["message"]["content"]),
        ("/v1/completions", COMPLETION, lambda o: o["choices"][0]["text"]),
        ("/generate", NATIVE, lambda o: o["output_ids"]),
    ):
        assert pick(_post(router, path, body)) == pick(_post(direct, path, body)), path
    assert _stream_text(router, "/v1/completions", COMPLETION) == _post(
        direct, "/v1/completions", COMPLETION)["choices"][0]["text"]
    assert _stream_text(router, "/v1/chat/completions", CHAT) == _post(
        direct, "/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]


def test_structured_output_and_the_openai_client_through_the_router(router, replicas) -> None:
    body = CHAT | {"response_format": {"type": "json_object"}, "max_tokens": 48}
    via = _post(router, "/v1/chat/completions", body)["choices"][0]
    assert via == _post(replicas[0].url, "/v1/chat/completions", body)["choices"][0]
    assert via["message"]["content"].lstrip().startswith("{")  # constrained (random weights)
    client = OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="demo", messages=CHAT["messages"], max_tokens=12,
                                         temperature=0)
    assert out.choices[0].message.content == _post(
        replicas[0].url, "/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]
