"""The reasoning parsers' split of an output into thinking and answer (server/reasoning.py): where
the output starts by the prompt's tags, the whole output's split, and the same split however the
text streams in (tags cut anywhere between deltas)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.args import template_kwargs
from server.protocol import ProtocolError, template_kwargs_of
from server.reasoning import CLOSED, INSIDE, NONE, ReasoningParser, ReasoningSplitter

QWEN3 = ReasoningParser("qwen3", False, start_token=10, end_token=11)
R1 = ReasoningParser("deepseek_r1", True, start_token=10, end_token=11)


def test_where_the_output_starts_is_read_from_the_prompts_last_tag() -> None:
    assert QWEN3.where([1, 2, 10, 3]) == INSIDE  # the template opened a span
    assert QWEN3.where([1, 10, 3, 11, 4]) == CLOSED  # enable_thinking false: an empty span
    assert QWEN3.where([1, 10, 11, 5, 10]) == INSIDE  # an earlier turn's span, then a new one
    assert QWEN3.where([1, 2]) == NONE  # the output may open one
    assert R1.where([1, 2]) == INSIDE  # DeepSeek-R1 always thinks
    assert R1.where([10, 11]) == CLOSED


@pytest.mark.parametrize(("text", "where", "expected"), [
    ("plan it</think>\n\nThe answer.", INSIDE, ("plan it", "The answer.")),
    ("still thinking", INSIDE, ("still thinking", None)),
    ("<think>echoed</think>answer", INSIDE, ("<think>echoed", "answer")),
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
