"""The offline API as a user calls it: prompts in every form, sampling options, finish rules."""

from __future__ import annotations

import pytest

from compiled_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(demo_dir: str) -> LLM:
    return LLM(demo_dir, deterministic=True, enforce_eager=True, num_pages=1000, max_running=8)


def test_text_token_and_chat_prompts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    text_out, ids_out, chat_out = llm.generate(
        [
            "Hello there",
            llm.tokenizer("Hello there").input_ids,
            [{"role": "user", "content": "Hello there"}],
        ],
        params,
    )
    assert text_out.token_ids == ids_out.token_ids and len(text_out.token_ids) == 5
    assert text_out.text == llm.tokenizer.decode(text_out.token_ids, skip_special_tokens=True)
    assert chat_out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1


def test_max_tokens_zero_generates_nothing(llm: LLM) -> None:
    out = llm.generate("Hi", SamplingParams(max_tokens=0))[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate("A seeded prompt", seeded)[0].token_ids
    noisy = SamplingParams(max_tokens=8, temperature=1.5, ignore_eos=True)
    crowded = llm.generate(["Other prompt", "A seeded prompt", "Third"], [noisy, seeded, noisy])[
        1
    ].token_ids
    assert alone == crowded
    other_seed = llm.generate(
        "A seeded prompt", SamplingParams(max_tokens=8, seed=43, ignore_eos=True)
    )[0]
    assert other_seed.token_ids != alone


def test_n_parallel_samples_differ_and_share_the_prompt(llm: LLM) -> None:
    out = llm.generate(
        "Tell me", SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    )[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(len(o.token_ids) == 6 for o in out.outputs)


def test_stop_string_ends_the_text_before_it(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = llm.generate("Stop here", greedy)[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), "the demo continuation should have text to stop on"
    out = llm.generate("Stop here", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                   stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]


def test_eos_ends_a_request_unless_ignored(llm: LLM) -> None:
    greedy = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0))[0]
    eos = greedy.token_ids[2]  # pretend the third greedy token is a stop token
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(eos,))
    )[0]
    assert out.token_ids == greedy.token_ids[:3] and out.finish_reason == "stop"
    held = llm.generate(
        "Hello", SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(eos,), min_tokens=4)
    )[0]
    assert len(held.token_ids) >= 4 and eos not in held.token_ids[:4]


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0]
    first = out.outputs[0]
    assert len(first.logprobs) == 4 and all(lp <= 0 for lp in first.logprobs)
    for token, lp, top in zip(first.token_ids, first.logprobs, first.top_logprobs):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp)


def test_bad_requests_are_rejected_with_a_clear_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 5000], SamplingParams())
    assert llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_a_rejected_prompt_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_work()
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1, 8000], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=(9000,), min_tokens=1), "stop_token_ids"),
        ([1, 2], SamplingParams(seed=2**64), "seed"),
    ],
)
def test_ids_and_seeds_the_model_cannot_take_are_rejected(
    llm: LLM, prompt, params, message
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert not llm.engine.has_work()
    assert llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_a_tiny_temperature_is_greedy(llm: LLM) -> None:
    greedy = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    tiny = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True))[0]
    assert tiny.token_ids == greedy.token_ids


def test_chat_takes_one_conversation_or_many_through_the_template(llm: LLM) -> None:
    """`LLM.chat` as vLLM's: the prompt is what transformers' chat template makes of the messages
    (tools included), one output per conversation, the same tokens as `generate` on that prompt."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    second = [{"role": "user", "content": "Name a color."}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}

    def template(conv: list[dict], **kw) -> list[int]:
        text = llm.tokenizer.apply_chat_template(conv, tokenize=False, **kw)
        return llm.tokenizer(text, add_special_tokens=False).input_ids

    (alone,) = llm.chat(first, params)
    both = llm.chat([first, second], params)
    assert alone.prompt_token_ids == template(first, add_generation_prompt=True)
    assert [o.prompt_token_ids for o in both] == [template(c, add_generation_prompt=True)
                                                  for c in (first, second)]
    assert [o.token_ids for o in both] == [
        o.token_ids for o in llm.generate([template(c, add_generation_prompt=True)
                                           for c in (first, second)], params)]
    assert both[0].token_ids == alone.token_ids
    (with_tool,) = llm.chat(second, params, tools=[tool])
    assert with_tool.prompt_token_ids == template(second, add_generation_prompt=True,
                                                  tools=[tool])
    assert "get_weather" in llm.tokenizer.decode(with_tool.prompt_token_ids)
    (no_header,) = llm.chat(second, params, add_generation_prompt=False)
    assert no_header.prompt_token_ids == template(second, add_generation_prompt=False)
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([], params)
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([[{"role": "user", "content": "a"}], "not a conversation"], params)


def test_generate_takes_a_priority_per_prompt(llm: LLM, demo_dir: str) -> None:
    """vLLM's `LLM.generate(priority=[...])`: refused under fcfs (this engine), one per prompt;
    under priority scheduling each prompt gets its own, and greedy answers are as without them."""
    prompts = ["one", "two", "three"]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts, params, priority=[0, 3, 0])
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        llm.generate(prompts, params, priority=[0, 1])
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    ranked = LLM(demo_dir, deterministic=True, enforce_eager=True, num_pages=1000, max_running=1,
                 scheduling_policy="priority")
    try:
        got = ranked.generate(prompts, params, priority=[5, -5, 0])
        assert [o.token_ids for o in got] == alone
    finally:
        ranked.engine.shutdown()
