"""One sub-request's output as its engine events arrive: the tokens, their log-probs, the text (cut
at a stop string) and the finish reason. The offline API and the server both fold events through
it."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_engine.scheduler.plan import PromptLogprob, TokenEvent
from compiled_engine.tokenization import IncrementalDetokenizer


@dataclass
class OutputStream:
    rid: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[PromptLogprob] | None = None  # prompt positions 1 .., when asked
    embedding: list[float] | None = None  # an embedding request's vector
    cached_tokens: int = 0  # prompt tokens not computed (prefix cache, KV tier)

    @property
    def text(self) -> str:
        return self.detok.text

    def apply(self, ev: TokenEvent) -> tuple[str, bool]:
        """Fold in one event of this request. Returns the text it added and whether a stop string
        ended the request here: the caller then tells the engine to finish it (no event says so).
        Events after the end (a token already in flight when a stop string matched) change
        nothing."""
        if self.finish_reason is not None:
            return "", False
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.embedding is not None:
            self.embedding = ev.embedding
        if ev.cached_tokens is not None:
            self.cached_tokens = ev.cached_tokens
        text = ""
        if ev.token is not None:
            self.token_ids.append(ev.token)
            self.logprobs.append(ev.logprob)
            self.top_logprobs.append(ev.top_logprobs or [])
            text = self.detok.add(ev.token)
            if self.detok.stopped and not ev.finished:
                self.finish_reason = "stop"
                return text, True
        if ev.finished:
            text += self.detok.flush()
            self.finish_reason, self.error = ev.finish_reason, ev.error
        return text, False
