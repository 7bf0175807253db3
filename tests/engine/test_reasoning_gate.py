"""The engine's gate of a thinking span (compiled_engine/reasoning_gate.py): the tokens it allows
before, inside and after the span, the budget that forces `</think>`, the grammar that starts only
after it, and no drafts inside it."""

import pytest
import torch

from compiled_engine.constraints import packed_tokens
from compiled_engine.reasoning_gate import ReasoningGate
from compiled_engine.sampling_params import ThinkingSpan

VOCAB, START, END, EOS = 40, 30, 31, 2


def allowed(mask: torch.Tensor) -> set[int]:
    bits = [(int(word) >> b) & 1 for word in mask.tolist() for b in range(32)]
    return {t for t in range(VOCAB) if bits[t]}


class OnlyToken:
    """A grammar whose document is one token `token`."""

    def __init__(self, token: int) -> None:
        self.token, self.done = token, False

    def next_mask(self) -> torch.Tensor:
        return packed_tokens(() if self.done else (self.token,), VOCAB)

    def accept(self, token: int) -> bool:
        self.done = token == self.token and not self.done
        return self.done

    def allowed_prefix(self, tokens):
        return tuple(tokens[:1]) if not self.done and tokens[:1] == [self.token] else ()

    def masks_along(self, tokens):
        return [(self.next_mask(), self.done)]

    complete = property(lambda self: self.done)
    terminated = property(lambda self: self.done)


def test_inside_a_span_anything_goes_until_the_budget_forces_its_end() -> None:
    gate = ReasoningGate(ThinkingSpan(START, END, opened=True, budget=3), OnlyToken(7), VOCAB)
    for token in (5, 6, 5):
        assert allowed(gate.next_mask()) == set(range(VOCAB))
        assert gate.accept(token) and not gate.complete
        assert gate.allowed_prefix([1, 2]) == ()  # no drafts inside the span
    assert allowed(gate.next_mask()) == {END}  # 3 thinking tokens: the span ends now
    assert not gate.accept(5)  # (the sampler never draws it: the mask rules it out)


def test_the_grammar_starts_after_the_span() -> None:
    gate = ReasoningGate(ThinkingSpan(START, END, opened=True), OnlyToken(7), VOCAB)
    assert gate.accept(9) and gate.accept(END)
    assert allowed(gate.next_mask()) == {7}
    assert gate.allowed_prefix([7, 8]) == (7,)
    assert gate.accept(7) and gate.complete and gate.terminated


def test_before_a_span_the_first_token_opens_one_or_begins_the_answer() -> None:
    gate = ReasoningGate(ThinkingSpan(START, END, opened=False, budget=0), OnlyToken(7), VOCAB)
    assert allowed(gate.next_mask()) == {7, START}
    assert gate.accept(START)
    assert allowed(gate.next_mask()) == {END}  # budget 0: the span closes at once
    answer_first = ReasoningGate(ThinkingSpan(START, END, opened=False), OnlyToken(7), VOCAB)
    assert answer_first.accept(7) and answer_first.terminated  # no span: the grammar had it


def test_a_budget_without_a_grammar_leaves_the_answer_free() -> None:
    gate = ReasoningGate(ThinkingSpan(START, END, opened=True, budget=1), None, VOCAB)
    assert gate.accept(4) and allowed(gate.next_mask()) == {END} and gate.accept(END)
    assert allowed(gate.next_mask()) == set(range(VOCAB)) and gate.accept(EOS)
    assert not gate.complete and gate.allowed_prefix([3, 4]) == (3, 4)


def test_a_span_is_checked() -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ThinkingSpan(START, END, True, budget=-1).validate()
    with pytest.raises(ValueError, match="two token ids"):
        ThinkingSpan(START, START, True).validate()
