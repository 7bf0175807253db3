"""A reasoning model's thinking span in front of a request's grammar: the structured output (and a
tool call it forces) applies to the answer after `</think>`, not to the thinking, and a thinking
token budget ends the span by forcing `</think>`. It serves a request as its `RequestGrammar` does
(the sampler's token masks, the committed tokens, the drafts), in three phases:

    before   the prompt did not open a span: the first token may open one (`<think>`) or begin
             the answer (the grammar's tokens)
    thinking any token; `</think>` alone once `budget` thinking tokens are out
    answer   the grammar's (any token without one)

No drafts are taken before the answer (speculation resumes after the span)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compiled_engine.constraints import RequestGrammar, every_token, packed_tokens
from compiled_engine.sampling_params import ThinkingSpan

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"


class ReasoningGate:
    def __init__(self, span: ThinkingSpan, grammar: RequestGrammar | None,
                 vocab_size: int) -> None:
        self.span = span
        self.grammar = grammar
        self.phase = THINKING if span.opened else BEFORE
        self.thought = 0  # thinking tokens so far
        self._only_end = packed_tokens((span.end_token,), vocab_size)
        self._all = every_token(vocab_size)
        self._start = packed_tokens((span.start_token,), vocab_size)

    def next_mask(self) -> torch.Tensor:
        if self.phase == THINKING:
            spent = self.span.budget is not None and self.thought >= self.span.budget
            return self._only_end if spent else self._all
        inner = self.grammar.next_mask() if self.grammar is not None else self._all
        return inner | self._start if self.phase == BEFORE else inner

    def accept(self, token: int) -> bool:
        if self.phase == THINKING:
            if token == self.span.end_token:
                self.phase = ANSWER
                return True
            spent = self.span.budget is not None and self.thought >= self.span.budget
            self.thought += 1
            return not spent
        if self.phase == BEFORE:
            if token == self.span.start_token:
                self.phase = THINKING
                return True
            self.phase = ANSWER
        return self.grammar.accept(token) if self.grammar is not None else True

    def allowed_prefix(self, tokens: Sequence[int]) -> tuple[int, ...]:
        if self.phase != ANSWER:
            return ()
        return self.grammar.allowed_prefix(tokens) if self.grammar is not None else tuple(tokens)

    def masks_along(self, tokens: Sequence[int]) -> list[tuple[torch.Tensor, bool]]:
        if self.phase == ANSWER and self.grammar is not None:
            return self.grammar.masks_along(tokens)
        if tokens and self.phase != ANSWER:
            raise ValueError("drafts inside a thinking span")
        return [(self.next_mask(), False)] * (len(tokens) + 1)

    @property
    def complete(self) -> bool:
        return self.phase == ANSWER and self.grammar is not None and self.grammar.complete

    @property
    def terminated(self) -> bool:
        return self.phase == ANSWER and self.grammar is not None and self.grammar.terminated
