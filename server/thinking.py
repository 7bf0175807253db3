"""One chat request's view of its thinking span (`--reasoning-parser`): where its output starts,
what the engine gates (structured output after the span, the thinking budget), and how its answer
is split into `reasoning` / `reasoning_content` and `content`, whole or as it streams."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.generation import Choice, Delta
from server.handlers import off_loop, template_args
from server.protocol import ChatRequest, ProtocolError, ReasoningOptions
from server.reasoning import ReasoningParser, ReasoningSplitter
from server.state import ServerState

# the thinking's keys in a message or a delta: vLLM's, and SGLang's (older vLLM clients read it)
REASONING_KEYS = ("reasoning", "reasoning_content")


@dataclass
class Thinking:
    parser: ReasoningParser | None  # None: the output is returned as it is
    where: str = ""  # where the output starts (`ReasoningParser.where`)
    options: ReasoningOptions = field(default_factory=ReasoningOptions)
    _splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)
    _held: dict[int, str] = field(default_factory=dict)  # stream_reasoning false: the thinking

    @classmethod
    async def of(cls, st: ServerState, req: ChatRequest) -> Thinking:
        """The request's view; sets the engine's gate on `req.params` where the request needs one
        (a structured output or tool call, a thinking budget)."""
        if req.thinking_budget is not None and st.reasoning is None:
            raise ProtocolError("'thinking_token_budget' needs a reasoning model served with "
                                "--reasoning-parser", "thinking_token_budget")
        if st.reasoning is None:
            return cls(None)
        where = st.reasoning.where(await off_loop(lambda: _generation_prompt(st, req)))
        if req.params.structured is not None or req.thinking_budget is not None:
            span = st.reasoning.span(where, req.thinking_budget)
            req.params = dataclasses.replace(req.params, thinking=span)
        return cls(st.reasoning if req.reasoning.separate else None, where, req.reasoning)

    def answer(self, text: str) -> str | None:
        """A whole output's answer (all of it without a parser)."""
        return text if self.parser is None else self.parser.split(text, self.where)[1]

    def fields(self, text: str) -> dict:
        """The thinking's message fields of a whole output (none without a parser or when the
        request leaves them out)."""
        if self.parser is None or not self.options.include:
            return {}
        return dict.fromkeys(REASONING_KEYS, self.reasoning(text))

    def reasoning(self, text: str) -> str | None:
        """A whole output's thinking (None: no span, or no parser)."""
        return None if self.parser is None else self.parser.split(text, self.where)[0]

    def reasoning_tokens(self, text: str, token_ids: list[int]) -> int:
        """How many of the output's tokens are its thinking span's (its tags included)."""
        if self.reasoning(text) is None:
            return 0
        end = self.parser.end_token
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)

    def usage_tokens(self, choices: Sequence[Choice]) -> int | None:
        """The thinking spans' tokens over `choices` (chat usage's `reasoning_tokens`; None: no
        parser)."""
        if self.parser is None:
            return None
        return sum(self.reasoning_tokens(c.detok.text, c.token_ids) for c in choices)

    def stream_delta(self, d: Delta) -> dict:
        """A streamed delta's fields: the thinking and the answer it makes certain."""
        splitter = self._splitters.setdefault(d.index, ReasoningSplitter(self.where))
        reasoning, content = splitter.feed(d.text)
        if d.finish_reason is not None:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.options.stream:  # sent whole once the span is over
            held = self._held.get(d.index, "") + reasoning
            over = splitter.phase not in ("opened", "thinking") or d.finish_reason is not None
            self._held[d.index], reasoning = ("", held) if over else (held, "")
        shown = reasoning and self.options.include
        delta = dict.fromkeys(REASONING_KEYS, reasoning) if shown else {}
        return delta | ({"content": content} if content else {})


def _generation_prompt(st: ServerState, req: ChatRequest) -> str:
    """The text the chat template adds for the reply: what it renders with the generation prompt
    beyond what it renders without (blocking: run off the event loop)."""
    tools, kwargs = template_args(st, req.tools, req.template_kwargs)

    def render(generation: bool) -> str:
        return st.tokenizer.apply_chat_template(
            req.messages, tokenize=False, add_generation_prompt=generation, tools=tools,
            **kwargs)

    with_reply, without = render(True), render(False)
    return with_reply[len(os.path.commonprefix([with_reply, without])):]
