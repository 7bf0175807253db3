"""Reasoning parsers (`--reasoning-parser`): a reasoning model's output is its thinking span,
`<think>` ... `</think>`, then its answer. The chat endpoints return the span as `reasoning` (and
`reasoning_content`, SGLang's and older vLLM's name) and the answer as `content`.

Where the output starts is read from the generation prompt, the text the chat template adds for the
reply (what it renders with `add_generation_prompt` beyond the conversation: the history's spans
and the users' text never count):
    inside   the prompt opened a span (DeepSeek-R1's template, Qwen3's thinking-only ones): the
             output is thinking until `</think>`
    closed   the prompt closed one (Qwen3's template with `enable_thinking: false`): all answer
    none     neither: `qwen3` reads a span only if the output opens one; `deepseek_r1` and
             `qwen3_thinking` (models that always think) read the output as thinking until
             `</think>`
An output that never closes its span is all thinking (`content` null). Both tags must be single
tokens of the vocabulary that the detokenizer keeps (as Qwen3's and DeepSeek-R1's are)."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.sampling_params import ThinkingSpan

START, END = "<think>", "</think>"
# parser -> whether the model always thinks (its output is a span even if nothing opened it)
PARSERS = {"qwen3": False, "deepseek_r1": True, "qwen3_thinking": True}
ALIASES = {"deepseek-r1": "deepseek_r1", "qwen3-thinking": "qwen3_thinking"}  # SGLang's names
INSIDE, CLOSED, NONE = "inside", "closed", "none"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    always_thinks: bool
    start_token: int
    end_token: int

    def where(self, generation_prompt: str) -> str:
        """Where the output starts after `generation_prompt`: INSIDE, CLOSED or NONE (the module's
        docstring)."""
        start, end = generation_prompt.rfind(START), generation_prompt.rfind(END)
        if start > end:
            return INSIDE
        if end > start:
            return CLOSED
        return INSIDE if self.always_thinks else NONE

    def span(self, where: str, budget: int | None) -> ThinkingSpan | None:
        """The engine's view of the span (structured output after it, the budget), None when the
        output has none to gate."""
        if where == CLOSED:
            return None
        return ThinkingSpan(self.start_token, self.end_token, where == INSIDE, budget)

    def split(self, text: str, where: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        splitter = ReasoningSplitter(where)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        reasoning += more_reasoning
        content += more_content
        return (reasoning if splitter.thought else None), (content or None)


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser `name` on this tokenizer; ValueError saying why it cannot serve."""
    name = ALIASES.get(name, name)
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of "
                         f"{', '.join([*PARSERS, *ALIASES])}")
    ids = []
    for tag in (START, END):
        tokens = tokenizer.encode(tag, add_special_tokens=False)
        if len(tokens) != 1 or tokenizer.decode(tokens, skip_special_tokens=True) != tag:
            raise ValueError(f"--reasoning-parser {name}: this model's tokenizer has no single "
                             f"token {tag!r} that decoding keeps, which the parser needs")
        ids.append(tokens[0])
    return ReasoningParser(name, PARSERS[name], *ids)


class ReasoningSplitter:
    """Splits an output's text, as it streams, into thinking and answer. Text that may be the start
    of a tag is held until the next text decides; the answer's leading whitespace (the newlines
    after `</think>`) is dropped."""

    def __init__(self, where: str) -> None:
        self.phase = {INSIDE: "opened", CLOSED: "answer", NONE: "before"}[where]
        self.thought = where == INSIDE  # a span was entered
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) text that `text` makes certain."""
        reasoning, content = "", ""
        text, self._held = self._held + text, ""
        while text:
            if self.phase in ("before", "opened"):  # does the output open (again) with <think>?
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.phase, self.thought, text = "thinking", True, stripped[len(START):]
                elif START.startswith(stripped):  # (or only whitespace): not decided yet
                    self._held = text
                    return reasoning, content
                else:
                    self.phase = "answer_start" if self.phase == "before" else "thinking"
            elif self.phase == "thinking":
                at = text.find(END)
                if at >= 0:
                    reasoning += text[:at]
                    self.phase, text = "answer_start", text[at + len(END):]
                    continue
                keep = _partial_tail(text, END)
                reasoning += text[:len(text) - keep]
                self._held = text[len(text) - keep:]
                return reasoning, content
            elif self.phase == "answer_start":
                text = text.lstrip()
                if text:
                    self.phase = "answer"
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held, at the output's end."""
        held, self._held = self._held, ""
        if self.phase in ("thinking", "opened"):
            return held, ""
        if self.phase == "before":
            return "", held.lstrip()
        return "", held if self.phase == "answer" else held.lstrip()


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be completed later)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
