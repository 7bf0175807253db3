"""OpenAI response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from compiled_engine.scheduler.plan import PromptLogprob
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


def usage(gen: Generation, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage of `gen`; `reasoning_tokens` (a reasoning model's thinking spans, None: not
    one) goes in `completion_tokens_details`, where OpenAI puts it."""
    p, c = gen.prompt_tokens, gen.completion_tokens
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


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

    def build(self, d: Delta, prompt_ids: list[int] | None = None, top: int = 0) -> dict:
        """`prompt_ids`: the echoed prompt, whose tokens get their log-probs from
        `d.prompt_logprobs` (`top` alternatives each; the first token has none: it has no
        context)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt_ids:
            self._add(out, prompt_ids[0], None, None)
            entries = d.prompt_logprobs or [(None, 0, None)] * (len(prompt_ids) - 1)  # failed
            for tok, (lp, _, alternatives) in zip(prompt_ids[1:], entries, strict=True):
                self._add(out, tok, lp, None if alternatives is None else alternatives[:top])
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


def prompt_logprobs(
    prompt_ids: list[int], entries: list[PromptLogprob] | None, top: int, token_text: TokenText
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a map from token id to
    {logprob, rank, decoded_token}: the prompt token, and the `top` most likely there (None when the
    request failed before they were computed)."""
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for tok, (lp, rank, alternatives) in zip(prompt_ids[1:], entries, strict=True):
        position = {str(tok): {"logprob": _lp(lp), "rank": rank, "decoded_token": token_text(tok)}}
        for i, (t, v) in enumerate(alternatives[:top]):
            position.setdefault(
                str(t), {"logprob": _lp(v), "rank": i + 1, "decoded_token": token_text(t)}
            )
        out.append(position)
    return out


def native_prompt_logprobs(entries: list[PromptLogprob]) -> list[dict | None]:
    """`/generate`'s prompt_logprobs: None for the first token, then per token its logprob, rank and
    top alternatives as [token id, logprob] pairs."""
    return [None] + [
        {"logprob": _lp(lp), "rank": rank, "top_logprobs": [[t, _lp(v)] for t, v in top]}
        for lp, rank, top in entries
    ]


def chat_logprobs(d: Delta, token_text: TokenText) -> dict:
    def entry(tok: int, lp: float | None) -> dict:
        s = token_text(tok)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}

    content = [entry(tok, lp) | {"top_logprobs": [entry(t, v) for t, v in top]}
               for tok, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True)]
    return {"content": content}
