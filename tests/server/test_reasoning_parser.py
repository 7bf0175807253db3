"""The reasoning parsers' split of an output into thinking and answer (server/reasoning.py): where
the output starts by the prompt's tags, the whole output's split, and the same split however the
text streams in (tags cut anywhere between deltas)."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.args import template_kwargs
from server.protocol import ProtocolError, template_kwargs_of
from server.reasoning import CLOSED, INSIDE, NONE, ReasoningParser, ReasoningSplitter

QWEN3 = ReasoningParser("qwen3", False, start_token=10, end_token=11)
R1 = ReasoningParser("deepseek_r1", True, start_token=10, end_token=11)


def test_where_the_output_starts_is_read_from_the_generation_prompt() -> None:
    assert QWEN3.where("<|im_start|>assistant\n<think>\n") == INSIDE  # the template opened one
    assert QWEN3.where("<|im_start|>assistant\n<think>\n\n</think>\n\n") == CLOSED  # thinking off
    assert QWEN3.where("<|im_start|>assistant\n") == NONE  # the output may open one
    assert R1.where("<｜Assistant｜>") == INSIDE  # DeepSeek-R1 always thinks
    assert R1.where("<think></think>") == CLOSED


@pytest.mark.parametrize(("text", "where", "expected"), [
    ("plan it</think>\n\nThe answer.", INSIDE, ("plan it", "The answer.")),
    ("still thinking", INSIDE, ("still thinking", None)),
    ("\n<think>echoed</think>answer", INSIDE, ("echoed", "answer")),  # the tag said again
    ("<thin", INSIDE, ("<thin", None)),
    ("</think>", INSIDE, ("", None)),
    ("\n<think>a</think> b", NONE, ("a", "b")),
    ("no span <think>x</think>", NONE, (None, "no span <think>x</think>")),
    ("<thi", NONE, (None, "<thi")),
    ("The answer.", CLOSED, (None, "The answer.")),
    ("", NONE, (None, None)),
])
def test_a_whole_output_splits_into_thinking_and_answer(text, where, expected) -> None:
    assert QWEN3.split(text, where) == expected


pieces = st.lists(st.sampled_from(["<", "<th", "<think>", "</", "</think", "</think>", "think>",
                                   ">", " ", "\n", "a", "bc", "<thinker>", "</thin"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces, st.sampled_from([INSIDE, NONE, CLOSED]), st.data())
def test_the_streamed_split_is_the_whole_split(parts, where, data) -> None:
    """However the output's text is cut into deltas, the thinking and answer streamed add up to the
    whole output's split."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter = ReasoningSplitter(where)
    reasoning, content = "", ""
    for delta in deltas:
        r, c = splitter.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    whole_reasoning, whole_content = QWEN3.split(text, where)
    assert (reasoning + r, content + c) == (whole_reasoning or "", whole_content or "")


def test_chat_template_kwargs_are_the_templates_variables_only() -> None:
    assert template_kwargs_of({"enable_thinking": False}) == {"enable_thinking": False}
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"not an id": 1},
                {"_private": 1}, ["enable_thinking"]):
        with pytest.raises(ProtocolError) as e:
            template_kwargs_of(bad)
        assert e.value.param == "chat_template_kwargs"
    assert template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(Exception, match="cannot set 'chat_template'"):
        template_kwargs('{"chat_template": "{{ 1 }}"}')


def test_the_generation_prompt_leaves_the_history_out() -> None:
    """Qwen3's own template adds no tag for the reply, while its history may hold a span (a tool
    loop's thinking): the output's start is NONE, not CLOSED by the history's `</think>`."""
    from transformers import AutoTokenizer

    from compiled_engine.models.demo import demo_model_dir
    from server.thinking import _generation_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    st = SimpleNamespace(tokenizer=tokenizer,
                         config=SimpleNamespace(default_chat_template_kwargs={}))
    req = SimpleNamespace(tools=None, template_kwargs={}, messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>x</think>y"},
        {"role": "user", "content": "</think>"}])
    assert _generation_prompt(st, req) == "<|assistant|>"
    assert QWEN3.where(_generation_prompt(st, req)) == NONE


def test_the_parsers_by_name() -> None:
    """SGLang's names too; a model that always thinks reads an unopened output as thinking."""
    from types import SimpleNamespace as Tokenizer

    from server.reasoning import reasoning_parser

    ids = {"<think>": [10], "</think>": [11]}
    tokenizer = Tokenizer(encode=lambda text, add_special_tokens: ids.get(text, [1, 2]),
                          decode=lambda tokens, skip_special_tokens: {10: "<think>",
                                                                      11: "</think>"}[tokens[0]])
    for name, always in (("qwen3", False), ("deepseek-r1", True), ("qwen3-thinking", True)):
        parser = reasoning_parser(name, tokenizer)
        assert (parser.start_token, parser.end_token) == (10, 11)
        assert parser.where("<|assistant|>") == (INSIDE if always else NONE)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("nope", tokenizer)
    no_tags = Tokenizer(encode=lambda text, add_special_tokens: [1, 2], decode=lambda *a, **k: "")
    with pytest.raises(ValueError, match="no single token '<think>'"):
        reasoning_parser("qwen3", no_tags)
