"""vLLM's `cache_salt` over HTTP: `usage.prompt_tokens_details.cached_tokens` counts only what the
same salt cached (another tenant's prompt is not found: 0), the answer is the same whatever the
salt, and a salt that is not a non-empty bounded string is a 400 naming the field."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from compiled_engine.sampling_params import MAX_CACHE_SALT_CHARS


def _prompt() -> str:
    """A prompt no other test sent (several pages long)."""
    tag = uuid.uuid4().hex
    words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog")
    return " ".join(f"{tag[i % 32]}{words[i % len(words)]}" for i in range(100))


def _salts() -> tuple[str, str]:
    """Two salts no other test used (a salt is a tenant's secret)."""
    return uuid.uuid4().hex, uuid.uuid4().hex


def _cached(usage) -> int:
    details = usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens or 0


def test_completions_share_cached_tokens_only_within_a_salt(client: openai.OpenAI) -> None:
    prompt = _prompt()
    a, b = _salts()

    def ask(salt: str):
        out = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"cache_salt": salt})
        return out.choices[0].text, _cached(out.usage), out.usage.prompt_tokens

    first, cached, n = ask(a)
    assert cached == 0 and n > 64
    other, cached, _ = ask(b)
    assert cached == 0, "another salt's prompt was reported as cached"
    same, cached, _ = ask(a)
    assert cached > n // 2, "the same salt shares its prefix"
    assert first == other == same


def test_chat_takes_the_salt(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": _prompt()}]
    a, b = _salts()

    def ask(salt: str) -> int:
        out = client.chat.completions.create(model="demo", messages=messages, max_tokens=2,
                                             temperature=0, extra_body={"cache_salt": salt})
        return _cached(out.usage)

    assert ask(a) == 0
    assert ask(b) == 0
    assert ask(a) > 0


def test_responses_take_the_salt(client: openai.OpenAI) -> None:
    prompt = _prompt()
    a, b = _salts()

    def ask(salt: str) -> int:
        out = client.responses.create(model="demo", input=prompt, max_output_tokens=2,
                                      temperature=0, store=False, extra_body={"cache_salt": salt})
        return out.usage.input_tokens_details.cached_tokens

    assert ask(a) == 0
    assert ask(b) == 0
    assert ask(a) > 0


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"]])
def test_a_bad_salt_is_a_400_naming_it(http: httpx.Client, salt) -> None:
    r = http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 1,
                                           "cache_salt": salt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    assert len(r.text) < 1000, "the error echoes the salt"
