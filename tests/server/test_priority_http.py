"""Priority scheduling through the server (`--scheduling-policy priority`, one running request at a
time): a high-priority request sent while a long low-priority one streams preempts it, finishes
first, and both answers are the tokens each gets alone (deterministic mode); under fcfs a priority
is a 400."""

from __future__ import annotations

import json

import pytest

from tests.helpers.servers import start_server, wait_idle

LOW = {"model": "demo", "prompt": "a long low-priority story", "max_tokens": 300,
       "temperature": 0, "ignore_eos": True, "priority": 10}
HIGH = {"model": "demo", "prompt": "an urgent question", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "priority": -5}


@pytest.mark.slow
def test_a_high_priority_request_preempts_and_both_get_their_tokens() -> None:
    server = start_server(engine=dict(scheduling_policy="priority", max_running=1,
                                      enforce_eager=True), debug=True)
    try:
        with server.http() as http:
            alone = {name: http.post("/v1/completions", json=body).json()["choices"][0]["text"]
                     for name, body in (("low", LOW), ("high", HIGH))}
            with http.stream("POST", "/v1/completions", json=LOW | {"stream": True}) as stream:
                events = _texts(stream.iter_lines())
                first = next(events)  # low is running
                high = http.post("/v1/completions", json=HIGH).json()["choices"][0]["text"]
                rest = "".join(events)
            stats = wait_idle(http)
        assert high == alone["high"]
        assert first + rest == alone["low"], "the preempted stream lost or changed tokens"
        # one running request at a time: high ran before low's end only by preempting it
        assert stats["num_preemptions"] == 1 and stats["integrity_error"] is None
    finally:
        server.stop()


def _texts(lines):
    """The text of each streamed chunk."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                yield choice["text"]


def test_fcfs_refuses_a_priority_on_every_endpoint(server) -> None:
    """The suite's shared server runs the default policy, fcfs: a priority is read (and refused)
    on completions, chat, responses, embeddings and /generate (top level, SGLang's; not in its
    sampling_params)."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    generate = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    with server.http() as http:
        for path, body in (("/v1/completions", HIGH), ("/v1/chat/completions", chat),
                           ("/v1/responses", {"model": "demo", "input": "Hi"}),
                           ("/v1/embeddings", {"model": "demo", "input": "Hi"}),
                           ("/generate", generate)):
            r = http.post(path, json=body | {"priority": 3})
            assert r.status_code == 400, (path, r.text)
            assert "priority scheduling is not enabled" in r.json()["error"]["message"]
            assert http.post(path, json=body | {"priority": 0}).status_code == 200, path
        r = http.post("/generate", json=generate | {"sampling_params": {"priority": 1}})
        assert r.status_code == 400 and "at the top level" in r.json()["error"]["message"]
