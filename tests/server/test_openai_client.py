"""The official openai client against the server."""

from __future__ import annotations

import openai
import pytest

from compiled_engine.models.demo import DEMO_LABEL


def test_models_lists_the_demo_model_as_random_weights(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].model_extra["description"] == DEMO_LABEL
    assert "random weights" in DEMO_LABEL


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="Hello world", max_tokens=8, temperature=0)
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Hi there"}],
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model="demo", prompt="The quick brown fox", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo",
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_n_greater_than_one_with_seed(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo",
        prompt="Once",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    again = client.completions.create(
        model="demo",
        prompt="Once",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    # same seed, same samples
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert len({c.text for c in out.choices}) > 1  # sample i uses seed + i


def test_streaming_n_greater_than_one(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="demo",
            prompt="Once",
            max_tokens=5,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length")
    assert finished == [0, 1]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo", prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely
        assert abs(max(top.values()) - logprob) < 1e-4
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Hey"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_string_is_cut_and_not_included(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(model="demo", prompt="Hello world", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = full[5:8]
    assert stop.strip(), full
    out = client.completions.create(
        model="demo", prompt="Hello world", max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]
    chunks = list(
        client.completions.create(
            model="demo", prompt="Hello world", max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_kept_with_no_stop_trim(client: openai.OpenAI) -> None:
    """SGLang's `no_stop_trim` (which its router sends) and vLLM's `include_stop_str_in_output`:
    the text ends with the matched stop string."""
    full = (
        client.completions.create(model="demo", prompt="Hello world", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = full[5:8]
    for field in ("no_stop_trim", "include_stop_str_in_output"):
        for stream in (False, True):
            out = client.completions.create(
                model="demo", prompt="Hello world", max_tokens=16, temperature=0, stop=[stop],
                stream=stream, extra_body={field: True},
            )
            chunks = list(out) if stream else [out]
            text = "".join(c.choices[0].text for c in chunks)
            assert text == full[: full.index(stop) + len(stop)], (field, stream, text)
            assert chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompts(client: openai.OpenAI) -> None:
    ids = client._client.post(
        client.base_url.join("/tokenize"), json={"prompt": "Hello world"}
    ).json()["tokens"]
    a = client.completions.create(model="demo", prompt="Hello world", max_tokens=6, temperature=0)
    b = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0)
    c = client.completions.create(model="demo", prompt=[ids], max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text


def test_bad_request_raises_with_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", max_tokens=8, temperature=-1)
    assert e.value.body["param"] == "temperature"
