"""OpenAI response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from server.generation import Delta, Generation

LOGPROB_FLOOR = -9999.0  # -inf is not JSON


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(obj: object) -> str:
    return f"data: {dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def _lp(x: float | None) -> float | None:
    if x is None or math.isnan(x):
        return None
    return max(x, LOGPROB_FLOOR)


def usage(gen: Generation) -> dict:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class TokenText:
    """Token id -> its text, cached per request."""

    tokenizer: object
    cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, tok: int) -> str:
        s = self.cache.get(tok)
        if s is None:
            s = self.cache[tok] = self.tokenizer.decode([tok])
        return s


@dataclass
class CompletionLogprobs:
    """The legacy completions `logprobs` object, built delta by delta (text offsets carry over)."""

    token_text: TokenText
    offset: int = 0

    def build(self, d: Delta, prompt_ids: list[int] | None = None) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok in prompt_ids or []:  # echoed prompt tokens have no logprobs
            self._add(out, tok, None, None)
        for tok, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True):
            self._add(out, tok, lp, top)
        return out

    def _add(self, out: dict, tok: int, lp: float | None, top: list | None) -> None:
        s = self.token_text(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append(
            None if top is None else {self.token_text(t): _lp(v) for t, v in top}
        )
        out["text_offset"].append(self.offset)
        self.offset += len(s)


def chat_logprobs(d: Delta, token_text: TokenText) -> dict:
    def entry(tok: int, lp: float | None) -> dict:
        s = token_text(tok)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}

    content = [entry(tok, lp) | {"top_logprobs": [entry(t, v) for t, v in top]}
               for tok, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True)]
    return {"content": content}
