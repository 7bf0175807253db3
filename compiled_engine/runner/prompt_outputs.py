"""What a step computes at prompt positions besides sampling: prompt log-probs (each prompt token's
log-probability given the tokens before it, from the logits at the position before it) and the
final hidden state of each position (embeddings). Both come out of the prefill that runs anyway: a
prompt log-prob is one more logits row of the step's forward, a hidden state is a row the forward
computes regardless."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compiled_engine.runner.sampler import top_logprobs
from compiled_engine.runner.staging import to_device


@dataclass(frozen=True, slots=True)
class KeptRows:
    """What one request keeps of its prefill chunk in a step: at each of the chunk's first
    `num_logprobs` positions, the log-prob of the prompt token after it (with the `top` most likely
    tokens there), and the final hidden state of each of the chunk's positions when `hidden`."""

    index: int  # the request's place in the plan
    num_logprobs: int = 0
    top: int = 0
    hidden: bool = False


@dataclass(slots=True)
class PromptLogprobRows:
    """Device tensors, one row per kept prompt position in `KeptRows` order."""

    logprobs: torch.Tensor  # [N] of the prompt token at the next position
    ranks: torch.Tensor  # [N] its rank among the vocabulary (1: the most likely)
    top_ids: torch.Tensor | None  # [N, K], K = the largest `top` asked (None when 0)
    top_logprobs: torch.Tensor | None


def logprob_targets(kept: Sequence[KeptRows], reqs, flat) -> list[int]:
    """Where each kept position's next token lies in the (flattened) token table; `flat(row, pos)`
    maps a table cell to its index."""
    return [
        flat(reqs[k.index].row, reqs[k.index].start + j + 1)
        for k in kept
        for j in range(k.num_logprobs)
    ]


ROWS_AT_ONCE = 256  # prompt positions whose float32 log-probs (and sort) are in memory at once


def prompt_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, targets: list[int], top: int
) -> PromptLogprobRows:
    """Log-probs of the raw logits (no sampling parameter applies to a prompt), in float32 as the
    sampler's, `ROWS_AT_ONCE` rows at a time: a long prompt's chunk has a row per position."""
    ids = tokens.index_select(0, to_device(targets, torch.long, logits.device))
    parts = []
    for lo in range(0, len(targets), ROWS_AT_ONCE):
        logp = torch.log_softmax(logits[lo : lo + ROWS_AT_ONCE].float(), dim=-1)
        chosen = logp.gather(1, ids[lo : lo + ROWS_AT_ONCE, None])
        best = top_logprobs(logp, top) if top > 0 else (None, None)
        parts.append((chosen.squeeze(1), (logp > chosen).sum(dim=1) + 1, best[1], best[0]))
    lp, ranks, top_ids, top_lp = (
        None if column[0] is None else torch.cat(column) for column in zip(*parts, strict=True)
    )
    return PromptLogprobRows(lp, ranks, top_ids, top_lp)


def hidden_rows(
    hidden: torch.Tensor, kept: Sequence[KeptRows], token_starts: list[int]
) -> list[torch.Tensor]:
    """The final hidden states of each `hidden` request's chunk, rows `token_starts[i]` ..
    `token_starts[i + 1]` of the forward's (copies: the graph's buffer is reused next step)."""
    return [
        hidden[token_starts[k.index] : token_starts[k.index + 1]].clone()
        for k in kept
        if k.hidden
    ]
