"""`serve --speculative-config` over HTTP on the real model (compiled, deterministic): a stream
sends each accepted token once, in order, and says what the non-streamed answer says; a stop string
that ends inside an accepted run cuts the text there; every answer equals the server's without
speculation; /metrics counts drafts under vLLM's names."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.speculative import PASSAGE
from tests.helpers.parity import ENGINE
from tests.helpers.servers import RunningServer
from tests.helpers.servers import servers as running_servers

pytestmark = pytest.mark.slow
SPEC = {"method": "ngram", "num_speculative_tokens": 7}
COPY = [{"role": "user",
         "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RunningServer]]:
    engine = dict(model="smollm2", enforce_eager=False, deterministic=True) | ENGINE
    spec = engine | {"speculative": SPEC}
    with running_servers({"start_timeout_s": 900, "engine": engine},
                         {"start_timeout_s": 900, "engine": spec}) as made:
        yield dict(zip(("plain", "spec"), made))


def _spec_counters(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode_")}


def _stream_tokens(http: httpx.Client, body: dict) -> tuple[list[str], str, str | None]:
    """A streamed completion's tokens (from its logprobs), text and finish reason."""
    tokens, text, reason = [], "", None
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
            reason = choice["finish_reason"] or reason
    return tokens, text, reason


def test_stream_sends_each_accepted_token_once_in_order(servers) -> None:
    with servers["spec"].http() as spec, servers["plain"].http() as plain:
        prompt = spec.post("/tokenize", json={"messages": COPY}).json()["tokens"]
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 96, "temperature": 0,
                "logprobs": 0}
        before = _spec_counters(spec)
        streamed = _stream_tokens(spec, body)
        after = _spec_counters(spec)
        whole = spec.post("/v1/completions", json=body).json()["choices"][0]
        reference = plain.post("/v1/completions", json=body).json()["choices"][0]
    assert streamed == (whole["logprobs"]["tokens"], whole["text"], whole["finish_reason"])
    assert whole["text"] == reference["text"]
    assert whole["logprobs"] == reference["logprobs"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    drafts = after["vllm:spec_decode_num_drafts_total"] - before.get(
        "vllm:spec_decode_num_drafts_total", 0)
    assert accepted >= 2 * drafts > 0  # verify steps emit several tokens each


def test_stop_string_inside_an_accepted_run_cuts_there(servers) -> None:
    """`stop` on a word the model copies from the middle of the passage: the answer ends just
    before it, as without speculation, though the verify step that produced it ran past it."""
    stop = "the free pages"
    body = {"model": "smollm2", "messages": COPY, "max_tokens": 128, "temperature": 0,
            "stop": [stop]}
    with servers["spec"].http() as spec, servers["plain"].http() as plain:
        for stream in (False, True):
            before = _spec_counters(spec)
            got = _chat(spec, body, stream)
            after = _spec_counters(spec)
            accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
                "vllm:spec_decode_num_accepted_tokens_total", 0)
            assert accepted > 20  # the answer was copied in accepted runs of drafts
            assert got == _chat(plain, body, stream)
            text, reason = got
            assert reason == "stop" and stop not in text
            assert PASSAGE.startswith(text.strip()[:40])  # it was copying
            assert PASSAGE.split(stop)[0].rstrip().endswith(text.strip()[-20:]), text


def _chat(http: httpx.Client, body: dict, stream: bool) -> tuple[str, str]:
    if not stream:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, reason = "", None
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason
