"""Structured output through the official openai client on the random demo model: the constraint,
not the weights, makes every answer parse. JSON schemas (OpenAI `response_format`, vLLM
`structured_outputs`, SGLang `json_schema` in /generate), regexes, choices and EBNF grammars; bad
constraints are 400s naming the field; constrained and unconstrained requests share batches without
changing the unconstrained tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.servers import assert_kv_all_free, wait_idle

SCHEMAS = {
    "nested objects and required fields": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "an array with bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["price", "count"],
    },
    "a string with a pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def _json_schema(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    out = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format=_json_schema(schema),
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_with_n_and_a_seed(client: openai.OpenAI, stream: bool) -> None:
    schema = SCHEMAS["nested objects and required fields"]
    kwargs = dict(model="demo", messages=MESSAGES, max_tokens=200, temperature=1.0, n=3, seed=11,
                  response_format=_json_schema(schema))
    if stream:
        texts = [""] * 3
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    again = [
        c.message.content
        for c in client.chat.completions.create(**kwargs | {"stream": False}).choices
    ]
    assert again == texts, "the same seed gives the same documents, streamed or not"


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "A pet"}],
        response_format=Pet,
        max_tokens=200,
        temperature=0,
    )
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish") and 0 <= pet.age <= 30


def test_json_object_gives_an_object(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="{", max_tokens=256, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # an unbounded object may run out of tokens: what came is still a prefix of one
        assert out.choices[0].text.startswith("{")


def test_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    def complete(constraint: dict) -> openai.types.Completion:
        return client.completions.create(
            model="demo",
            prompt="Say something",
            max_tokens=64,
            temperature=0.8,
            seed=3,
            n=4,
            extra_body={"structured_outputs": constraint},
        )

    for c in complete({"regex": r"[a-c]{3}-\d{2}"}).choices:
        assert re.fullmatch(r"[a-c]{3}-\d{2}", c.text) and c.finish_reason == "stop"
    for c in complete({"choice": ["yes", "no", "maybe so"]}).choices:
        assert c.text in ("yes", "no", "maybe so") and c.finish_reason == "stop"
    grammar = 'root ::= num "+" num "=" num\nnum ::= [0-9] | [1-9] [0-9]'
    for c in complete({"grammar": grammar}).choices:
        assert (
            re.fullmatch(r"(\d|[1-9]\d)\+(\d|[1-9]\d)=(\d|[1-9]\d)", c.text)
            and c.finish_reason == "stop"
        )


def test_native_generate_takes_sglang_fields(server) -> None:
    with server.http() as http:
        r = http.post(
            "/generate",
            json={
                "text": "x",
                "sampling_params": {"regex": "(ab|cd){2}", "max_new_tokens": 16, "temperature": 0},
            },
        )
        assert r.status_code == 200, r.text
        assert re.fullmatch("(ab|cd){2}", r.json()["text"])
        schema = SCHEMAS["enums"]
        r = http.post(
            "/generate",
            json={
                "text": "x",
                "sampling_params": {
                    "json_schema": json.dumps(schema),
                    "max_new_tokens": 64,
                    "temperature": 0,
                },
            },
        )
        jsonschema.validate(json.loads(r.json()["text"]), schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object"}},
                }
            },
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        # strict said explicitly: a keyword decoding does not enforce cannot be promised
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {
                            "type": "array",
                            "items": {"type": "integer"},
                            "uniqueItems": True,
                        },
                    },
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {"structured_outputs": {"json": {"$ref": "http://127.0.0.1:9/s.json"}}},
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(server, body: dict, param: str) -> None:
    with server.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": "demo", "messages": MESSAGES, "max_tokens": 4} | body,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        ok = http.post(
            "/v1/completions", json={"model": "demo", "prompt": "still", "max_tokens": 2}
        )
        assert ok.status_code == 200
        assert_kv_all_free(wait_idle(http))


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(
    client: openai.OpenAI,
) -> None:
    prompts = [f"Tell me about number {i}" for i in range(6)]

    def plain(prompt: str) -> str:
        return client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def constrained(i: int) -> str:
        return (
            client.chat.completions.create(
                model="demo",
                messages=MESSAGES,
                max_tokens=200,
                temperature=0.7,
                seed=i,
                response_format=_json_schema(SCHEMAS["numbers"]),
            )
            .choices[0]
            .message.content
        )

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        mixed = [pool.submit(constrained, i) for i in range(6)]
        together = list(pool.map(plain, prompts))
        for f in mixed:
            jsonschema.validate(json.loads(f.result()), SCHEMAS["numbers"])
    assert together == alone


OPEN_OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}  # other properties are allowed: the schema does not say otherwise


@pytest.mark.parametrize("strict", [True, False, None], ids=["strict", "not strict", "absent"])
def test_strict_decides_whether_other_properties_may_appear(
    client: openai.OpenAI, strict: bool | None
) -> None:
    """`strict` true or absent (as vLLM and SGLang compile every schema), only the properties the
    schema names (the object closes after "a"); false, any document the schema validates (the random
    model opens another property)."""
    spec = {"name": "a", "schema": OPEN_OBJECT} | ({} if strict is None else {"strict": strict})
    out = client.completions.create(
        model="demo",
        prompt="x",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": spec}},
    )
    choice = out.choices[0]
    if strict is not False:
        assert choice.finish_reason == "stop" and list(json.loads(choice.text)) == ["a"]
    else:
        assert re.match(r'\{"a": \d, "', choice.text), choice.text


def test_a_constraint_no_token_can_continue_ends_in_error(server) -> None:
    """The pattern needs a raw control character, which JSON output never holds: after '"a' no token
    is allowed. The choice ends with finish_reason "error" (not an unconstrained answer); the server
    serves on."""
    stuck = {"json": {"type": "string", "pattern": "^a\u0001b$"}}
    with server.http() as http:
        r = http.post(
            "/v1/completions",
            json={
                "model": "demo",
                "prompt": "x",
                "max_tokens": 16,
                "temperature": 0,
                "structured_outputs": stuck,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "error" and choice["text"] == '"a', choice
        ok = http.post("/v1/completions", json={"model": "demo", "prompt": "still", "max_tokens": 2,
                                                "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert_kv_all_free(wait_idle(http))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            # RE2 takes it (server/schema_guard.py), xgrammar does not
            {"messages": MESSAGES, "n": 2, "structured_outputs": {"regex": "\\pL+"}},
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"grammar": "root ::= undefined_rule"}},
            "structured_outputs.grammar",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "(?P<n>a)", "max_new_tokens": 4}},
            "sampling_params.regex",
        ),
    ],
)
def test_a_constraint_the_engine_cannot_compile_is_a_400_and_the_engine_serves_on(
    server, stream: bool, path: str, body: dict, param: str
) -> None:
    """The engine compiles each constraint (once): one that does not compile comes back as the
    request's 400 naming its field, streamed or not, and the next constrained request is served."""
    with server.http() as http:
        limit = {} if path == "/generate" else {"max_tokens": 4}
        r = http.post(path, json={"model": "demo", "stream": stream} | limit | body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        assert r.json()["error"]["message"].startswith("invalid "), r.json()
        ok = http.post("/v1/completions", json={"model": "demo", "prompt": "still", "max_tokens": 8,
                                                "structured_outputs": {"regex": "(ab|cd){2}"}})
        assert ok.status_code == 200 and re.fullmatch(
            "(ab|cd){2}", ok.json()["choices"][0]["text"]
        ), ok.text
        assert_kv_all_free(wait_idle(http))
