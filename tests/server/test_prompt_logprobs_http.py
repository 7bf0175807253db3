"""`prompt_logprobs` (vLLM's field: completions, chat completions and /generate) and `echo` with
`logprobs` through
the served demo model (compiled, fp32, as `serve` runs it) against transformers fp32 on the same
checkpoint: the prompt tokens' log-probs as transformers computes them, the same alone, in a batch,
streamed or not, and with the prompt already in the prefix cache (such a request recomputes its
prompt: a cache hit would skip the positions whose log-probs it returns)."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch

TOLERANCE = 1e-4  # fp32 against fp32: summation order only
PROMPTS = [
    [1] + list(range(200, 290)),  # longer than a page: a prefix-cache hit would skip pages
    [1, 17, 4000, 23, 900, 5],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
]


@pytest.fixture(scope="module")
def hf_logprobs(hf_demo):
    """prompt -> transformers fp32's [len - 1, vocab] log-probs of each next token."""
    model = hf_demo

    def of(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1)

    return of


def completion(client: openai.OpenAI, prompt, **kwargs):
    return client.completions.create(model="demo", prompt=prompt, temperature=0,
                                     **{"max_tokens": 1} | kwargs)


def vllm_entries(choice) -> list[dict | None]:
    return choice.model_extra["prompt_logprobs"]


def check_against(entries: list[dict | None], prompt: list[int], ref: torch.Tensor, top: int):
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}} holding the prompt
    token and the `top` most likely there, all as transformers computes them."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i, (tok, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
        row = ref[i]
        mine = entry[str(tok)]
        assert mine["logprob"] == pytest.approx(row[tok].item(), abs=TOLERANCE)
        assert mine["rank"] == int((row > row[tok]).sum()) + 1
        # the alternatives are transformers' top tokens with their ranks (random fp32 weights: no
        # ties), plus the prompt token when it is not among them
        best = row.topk(top).indices.tolist()
        assert set(entry) == {str(t) for t in best} | {str(tok)}
        for rank, t in enumerate(best, start=1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(row[t].item(), abs=TOLERANCE)


def test_prompt_logprobs_equal_transformers_alone_batched_and_after_a_cache_hit(
    client: openai.OpenAI, hf_logprobs
) -> None:
    refs = [hf_logprobs(p) for p in PROMPTS]
    alone = [vllm_entries(completion(client, p, extra_body={"prompt_logprobs": 3}).choices[0])
             for p in PROMPTS]
    for entries, prompt, ref in zip(alone, PROMPTS, refs, strict=True):
        check_against(entries, prompt, ref, 3)
    # one request of three prompts, and three concurrent requests: the same numbers, bit for bit
    batched = completion(client, PROMPTS, extra_body={"prompt_logprobs": 3}).choices
    assert [vllm_entries(c) for c in sorted(batched, key=lambda c: c.index)] == alone
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(
            lambda p: vllm_entries(completion(client, p, extra_body={"prompt_logprobs": 3})
                                   .choices[0]), PROMPTS))
    assert together == alone
    # the prompt is in the prefix cache now (and a plain request reuses it); the log-probs are
    # recomputed, not skipped
    completion(client, PROMPTS[0], max_tokens=2)
    again = completion(client, PROMPTS[0], extra_body={"prompt_logprobs": 3}).choices[0]
    assert vllm_entries(again) == alone[0]


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, hf_logprobs) -> None:
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    prompt = PROMPTS[1]
    ref = hf_logprobs(prompt)
    out = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=2, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, tok in enumerate(prompt[1:]):
        assert lp.token_logprobs[i + 1] == pytest.approx(ref[i, tok].item(), abs=TOLERANCE)
        assert sorted(lp.top_logprobs[i + 1].values(), reverse=True) == pytest.approx(
            ref[i].topk(2).values.tolist(), abs=TOLERANCE)
    assert choice.text == "".join(lp.tokens)
    assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked: vLLM's field absent
    # echo + logprobs with generated tokens: the prompt's entries first, then the output's
    out = client.completions.create(model="demo", prompt=prompt, max_tokens=3, echo=True,
                                    logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 3
    assert lp.token_logprobs[1] == pytest.approx(ref[0, prompt[1]].item(), abs=TOLERANCE)
    assert all(v is not None for v in lp.token_logprobs[1:])


def test_streamed_prompt_logprobs_come_with_each_choices_first_chunk(client: openai.OpenAI) -> None:
    whole = completion(client, PROMPTS[1], max_tokens=4, extra_body={"prompt_logprobs": 1})
    chunks = list(client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=4,
                                            temperature=0, n=2, stream=True,
                                            extra_body={"prompt_logprobs": 1}))
    firsts: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            extra = (c.model_extra or {}).get("prompt_logprobs")
            if c.index in firsts:
                assert extra is None
            else:
                firsts[c.index] = extra
    assert firsts == {0: vllm_entries(whole.choices[0]), 1: vllm_entries(whole.choices[0])}


def test_generate_returns_prompt_logprobs(server, hf_logprobs) -> None:
    prompt = PROMPTS[2]
    ref = hf_logprobs(prompt)
    with server.http() as http:
        r = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 2, "temperature": 0, "prompt_logprobs": 2}})
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, (tok, e) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
        assert e["logprob"] == pytest.approx(ref[i, tok].item(), abs=TOLERANCE)
        assert [t for t, _ in e["top_logprobs"]] == ref[i].topk(2).indices.tolist()


@pytest.mark.parametrize("value", [-1, 21, "3", 1.5])
def test_bad_prompt_logprobs_are_400s(server, value) -> None:
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        r = http.post("/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "prompt_logprobs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs_score_the_templated_prompt(server, hf_logprobs) -> None:
    """vLLM's chat field: the response's `prompt_logprobs` are the templated prompt's, as
    transformers scores those tokens; with `stream` it is a 400 (not silently dropped)."""
    messages = [{"role": "user", "content": "Name a color."}]
    with server.http() as http:
        ids = http.post("/tokenize", json={"model": "demo", "messages": messages}).json()["tokens"]
        r = http.post("/v1/chat/completions", json={"model": "demo", "messages": messages,
                                                     "max_tokens": 1, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        check_against(r.json()["prompt_logprobs"], ids, hf_logprobs(ids), 2)
        r = http.post("/v1/chat/completions", json={"model": "demo", "messages": messages,
                                                     "max_tokens": 1, "prompt_logprobs": 2,
                                                     "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
