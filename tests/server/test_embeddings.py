"""`POST /v1/embeddings` through the official openai client against the served demo model
(compiled, fp32, as `serve` runs it, `--pooling last` by default): transformers fp32's final hidden
state of the last token, L2-normalized; base64 the same floats; a batch of 64 equal to each input
alone; the engine keeps serving and frees the requests' pages."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

from tests.helpers.servers import assert_kv_all_free, start_server

TOLERANCE = 1e-5
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a", "Embeddings from a decoder " * 20]


@pytest.fixture(scope="module")
def hf_pooled(hf_demo):
    """token ids -> transformers fp32's final hidden states pooled (last, mean), normalized."""
    model = hf_demo

    def of(ids: list[int]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        norm = torch.nn.functional.normalize
        return {"last": norm(states[-1], dim=0), "mean": norm(states.mean(0), dim=0)}

    return of


def ids_of(server, text: str) -> list[int]:
    return server.state.tokenizer(text).input_ids


def test_embeddings_equal_transformers_last_token_pooling(client, server, hf_pooled) -> None:
    out = client.embeddings.create(model="demo", input=TEXTS)
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    for d, text in zip(out.data, TEXTS, strict=True):
        ref = hf_pooled(ids_of(server, text))["last"]
        got = torch.tensor(d.embedding)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= TOLERANCE
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert out.usage.prompt_tokens == sum(len(ids_of(server, t)) for t in TEXTS)
    assert out.usage.total_tokens == out.usage.prompt_tokens
    # token ids in, and base64 out: the same float32 values
    ids = ids_of(server, TEXTS[0])
    raw = client.embeddings.with_raw_response.create(model="demo", input=[ids],
                                                     encoding_format="base64").http_response
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert list(floats) == pytest.approx(out.data[0].embedding, abs=0)
    # the client's default (it asks for base64 and decodes) gives the same
    assert client.embeddings.create(model="demo", input=ids).data[0].embedding == pytest.approx(
        out.data[0].embedding, abs=0)


def test_a_batch_of_64_equals_each_input_alone(client) -> None:
    texts = [f"input number {i}: " + "word " * (i % 13) for i in range(64)]
    batch = client.embeddings.create(model="demo", input=texts).data
    for i, text in enumerate(texts):
        alone = client.embeddings.create(model="demo", input=text).data[0].embedding
        assert batch[i].embedding == alone


def test_the_engine_keeps_serving_and_frees_the_pages(client, server) -> None:
    client.embeddings.create(model="demo", input=TEXTS)
    with server.http() as http:
        integrity = http.get("/debug/integrity").json()
    assert integrity["num_running"] == 0 and integrity["num_waiting"] == 0, integrity
    assert_kv_all_free(integrity)  # every page free or held by the prefix cache
    out = client.completions.create(model="demo", prompt="Hi", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], "x", 5]}, "input"),
        ({"input": [10**9]}, "input"),
        ({}, "input"),
        ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param) -> None:
    with server.http() as http:
        r = http.post("/v1/embeddings", json={"model": "demo", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_dimensions_equal_to_the_models_are_taken(client, server) -> None:
    size = len(client.embeddings.create(model="demo", input="hi").data[0].embedding)
    out = client.embeddings.create(model="demo", input="hi", dimensions=size)
    assert len(out.data[0].embedding) == size
    assert size == server.state.client.handle.ready.hidden_size


def test_mean_pooling_server_equals_transformers(server, hf_pooled) -> None:
    """`serve --pooling mean` (its own server; the compiled graphs are the shared ones)."""
    mean = start_server(pooling="mean")
    try:
        out = mean.openai().embeddings.create(model="demo", input=TEXTS[:2])
        for d, text in zip(out.data, TEXTS[:2], strict=True):
            ref = hf_pooled(ids_of(server, text))["mean"]
            assert (torch.tensor(d.embedding) - ref).abs().max().item() <= TOLERANCE
    finally:
        mean.stop()
