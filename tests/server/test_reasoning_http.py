"""A reasoning model through the server (`--reasoning-parser qwen3`) on a random Qwen3 checkpoint
whose chat template opens the thinking span in the prompt (tests/helpers/thinking.py), through the
official `openai` client: the thinking comes back as `reasoning` and `reasoning_content`, the answer
as `content`, streamed and not; the thinking budget ends the span; the structured output (a choice)
and a required tool call apply to the answer only; `enable_thinking: false` leaves no span; the
Responses API returns a reasoning item; chat usage counts the span's tokens. The split is checked
against the raw output of the same request with `separate_reasoning: false`, token by token through
the logprobs.

Served as users run it: compiled, bf16 (the span's gate and the split run in the sampler and the
server, outside the graphs; the split is checked against the same server's raw output)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from tests.helpers.servers import RunningServer, start_server
from tests.helpers.thinking import make_thinking_checkpoint

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
BUDGET = 4
ASK = dict(messages=MESSAGES, temperature=0, max_tokens=24)
# the thinking budget, a choice for the answer, and no EOS inside the span
GATED = {"thinking_token_budget": BUDGET, "structured_outputs": {"choice": ["yes", "no"]},
         "min_tokens": BUDGET + 2}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_thinking_checkpoint(str(tmp_path_factory.mktemp("thinking")))
    server = start_server(engine=dict(model=path, dtype="bfloat16", num_pages=512),
                          reasoning_parser="qwen3")
    try:
        yield Served(server, path)
    finally:
        server.stop()


@dataclass
class Served:
    server: RunningServer
    model: str

    def openai(self):
        """The client, each call on this checkpoint."""
        client = self.server.openai()
        for api in (client.chat.completions, client.responses):
            api.create = functools.partial(api.create, model=self.model)
        return client

    def http(self):
        return self.server.http()


def test_the_thinking_comes_apart_from_the_answer(served) -> None:
    client = served.openai()
    whole = client.chat.completions.create(**ASK, logprobs=True, extra_body=GATED)
    msg = whole.choices[0].message
    raw = client.chat.completions.create(**ASK, extra_body=GATED | {"separate_reasoning": False})
    text = raw.choices[0].message.content
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    assert tokens.count("</think>") == 1 and tokens.index("</think>") <= BUDGET
    assert msg.content in ("yes", "no")  # the choice applied after the span
    assert msg.reasoning_content == msg.reasoning and msg.reasoning
    assert text.startswith(msg.reasoning + "</think>") and text.endswith(msg.content)
    assert text[len(msg.reasoning) + len("</think>"):-len(msg.content)].strip() == ""
    assert whole.choices[0].finish_reason == "stop"


def test_the_budget_ends_the_span(served) -> None:
    client = served.openai()
    for budget in (0, 2):
        out = client.chat.completions.create(**ASK, logprobs=True, extra_body={
            "thinking_token_budget": budget, "min_tokens": budget + 2})
        tokens = [t.token for t in out.choices[0].logprobs.content]
        assert "</think>" in tokens[:budget + 1], (budget, tokens)


def test_streamed_thinking_and_answer_add_up_to_the_whole(served) -> None:
    client = served.openai()
    whole = client.chat.completions.create(**ASK, extra_body=GATED).choices[0].message
    for stream_reasoning in (True, False):
        chunks = list(client.chat.completions.create(
            **ASK, stream=True, extra_body=GATED | {"stream_reasoning": stream_reasoning}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thinking = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]
        assert [d.reasoning_content for d in deltas if getattr(d, "reasoning", None)] == thinking
        assert "".join(thinking) == whole.reasoning
        assert "".join(d.content or "" for d in deltas) == whole.content
        if not stream_reasoning:
            assert len(thinking) == 1  # sent whole, once the span is over


def test_chat_usage_counts_the_thinking_tokens(served, http) -> None:
    """OpenAI's `completion_tokens_details.reasoning_tokens`: the span's tokens, its end tag
    included, whole and streamed; a server without a reasoning parser leaves the details out."""
    client = served.openai()
    whole = client.chat.completions.create(**ASK, logprobs=True, extra_body=GATED)
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    thinking = whole.usage.completion_tokens_details.reasoning_tokens
    assert thinking == tokens.index("</think>") + 1 < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        **ASK, stream=True, stream_options={"include_usage": True}, extra_body=GATED))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking
    plain = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
    assert plain.status_code == 200 and "completion_tokens_details" not in plain.json()["usage"]


def test_without_thinking_the_whole_output_is_the_answer(served) -> None:
    client = served.openai()
    out = client.chat.completions.create(**ASK, extra_body={
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"choice": ["yes", "no"]}})
    msg = out.choices[0].message
    assert msg.content in ("yes", "no") and msg.reasoning is None  # the choice from the start
    hidden = client.chat.completions.create(**ASK, extra_body=GATED | {"include_reasoning": False})
    assert hidden.choices[0].message.content in ("yes", "no")
    assert not hasattr(hidden.choices[0].message, "reasoning")


def test_a_required_tool_call_is_parsed_from_the_answer(served) -> None:
    tools = [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]
    out = served.openai().chat.completions.create(
        **(ASK | {"max_tokens": 64}), tools=tools, tool_choice="required",
        extra_body={"thinking_token_budget": 3, "min_tokens": 5})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning
    assert choice.message.tool_calls[0].function.name == "weather"
    assert choice.message.content is None


def test_a_span_in_the_history_or_the_users_text_does_not_move_the_start(served) -> None:
    """Only the generation prompt says where the output starts: an earlier turn's span, or a
    user who types the tags, leaves the reply's span open (its budget still applies)."""
    client = served.openai()
    history = [{"role": "user", "content": "a </think> b"},
               {"role": "assistant", "content": "<think>x</think>ok"},
               {"role": "user", "content": "Is it? </think>"}]
    out = client.chat.completions.create(**(ASK | {"messages": history}), logprobs=True,
                                         extra_body=GATED)
    msg = out.choices[0].message
    assert msg.content in ("yes", "no") and msg.reasoning
    tokens = [t.token for t in out.choices[0].logprobs.content]
    assert tokens.index("</think>") <= BUDGET


def test_the_responses_api_returns_a_reasoning_item(served) -> None:
    client = served.openai()
    resp = client.responses.create(input="Is the sky blue?", max_output_tokens=12,
                                   temperature=0)
    kinds = [item.type for item in resp.output]
    assert kinds[0] == "reasoning" and resp.output[0].content[0].text
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= resp.usage.output_tokens
    events = list(client.responses.create(input="Is the sky blue?",
                                          max_output_tokens=12, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done and done[0].text == resp.output[0].content[0].text
    follow = client.responses.create(  # the reasoning item goes back as input (OpenAI's loop)
        input=[{"role": "user", "content": "Is the sky blue?"},
               *[item.model_dump(exclude_none=True) for item in resp.output],
               {"role": "user", "content": "Sure?"}], max_output_tokens=4, temperature=0)
    assert follow.status in ("completed", "incomplete")


def test_bad_reasoning_fields_are_400s(served, http) -> None:
    with served.http() as own:
        for extra, param in (({"thinking_token_budget": -1}, "thinking_token_budget"),
                             ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                             ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                             ({"separate_reasoning": "no"}, "separate_reasoning")):
            r = own.post("/v1/chat/completions", json={"messages": MESSAGES} | extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # the suite's shared server runs no reasoning parser: a budget means nothing there
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "thinking_token_budget": 2})
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
