"""Speculative decoding in the ledger: how many draft tokens a request's next step carries, which of
them a verify step accepts, and the per-request policy that stops speculating where it does not pay.

A verify step computes the request's last token and its k drafts as one extend row and samples at
each of the 1 + k positions; the sampled token at position i is the target model's own draw there
(greedy, or with the random numbers of that position: `runner.sampler`). The drafts are accepted up
to the first one that differs from the draw at its position, and the draw there (or after the last
draft: the bonus token) is kept too. For drafts proposed deterministically (n-gram lookup, a draft
model's argmax) this is the standard rejection rule: a draft d is accepted with probability p(d),
and on rejection the token is drawn from p without d, renormalized. So the output is exactly what
the request gives without speculation: the same tokens where the draws are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How the ledger speculates (`EngineConfig.speculative` is the user's side of it)."""

    num_speculative_tokens: int  # k: draft tokens per verify step, at most
    # a request whose drafts are accepted less often than this over `window` drafted tokens pauses
    min_acceptance: float = 0.3
    window: int = 16
    retry_after: int = 32  # steps a paused request decodes plainly before it drafts again
    # under overlap, steps a request whose proposer had nothing decodes (instead of waiting for its
    # token in flight to propose) before it waits to propose again
    empty_retry: int = 4
    # While more than `max_batch` requests run, only those whose verify steps recently accepted at
    # least `copy_accepted` drafts (on average) draft: verify tokens are not free in a large batch,
    # and only a request that copies long runs gains more than they cost there.
    max_batch: int = 2
    copy_accepted: float = 4.0

    def validate(self) -> None:
        for ok, message, value in (
            (self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1",
             self.num_speculative_tokens),
            (0.0 <= self.min_acceptance <= 1.0, "min_acceptance must be in [0, 1]",
             self.min_acceptance),
            (self.window >= 1, "window must be >= 1", self.window),
            (self.retry_after >= 0, "retry_after must be >= 0", self.retry_after),
            (self.empty_retry >= 1, "empty_retry must be >= 1", self.empty_retry),
            (self.max_batch >= 1, "max_batch must be >= 1", self.max_batch),
            (self.copy_accepted >= 0, "copy_accepted must be >= 0", self.copy_accepted),
        ):
            if not ok:
                raise ValueError(f"speculative: {message}, got {value!r}")


@dataclass(slots=True)
class SpecStats:
    """One request's acceptance: over its current window (the pause rule), and as a moving average
    of the drafts its verify steps accept (the draft length rule); the step its pause ends at; its
    latest verify step and empty proposal (the overlap rules, `decode.py`)."""

    drafted: int = 0
    accepted: int = 0
    paused_until: int = -1
    recent_accepted: float | None = None  # None: no verify step yet
    verify_step: int = -1  # the latest step that carried its drafts
    empty_at: int = -(1 << 30)  # the latest step its proposer had nothing for

    def drafts_in_batch(self, config: SpecConfig, running: int) -> bool:
        """Whether the request drafts in a batch of `running` requests (the batch rule): above
        `max_batch` only if it has been measured copying (in a smaller batch)."""
        return running <= config.max_batch or (
            self.recent_accepted is not None and self.recent_accepted >= config.copy_accepted
        )

    def draft_len(self, config: SpecConfig) -> int:
        """Drafts to ask for: k at first, then about twice what recent steps accepted (at least
        1), so that a request whose drafts mostly fail verifies short runs, which cost little more
        than a decode, and one that copies verifies long ones."""
        k = config.num_speculative_tokens
        if self.recent_accepted is None:
            return k
        return max(1, min(k, math.ceil(2 * self.recent_accepted)))

    def record(self, config: SpecConfig, step: int, drafted: int, accepted: int) -> None:
        """Count one verify step; pause when the window's acceptance is below the threshold."""
        prev = self.recent_accepted
        self.recent_accepted = accepted if prev is None else (prev + accepted) / 2
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted >= config.window:
            if self.accepted < config.min_acceptance * self.drafted:
                self.paused_until = step + config.retry_after
            self.drafted = self.accepted = 0


@dataclass(slots=True)
class SpecCounters:
    """Totals over every request (vLLM's `spec_decode_*` counters)."""

    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def accepted_prefix(draft: tuple[int, ...], sampled: list[int]) -> int:
    """How many leading drafts equal the target's draw at their position (`sampled[i]` is the draw
    after the request's last token and drafts[:i])."""
    j = 0
    while j < len(draft) and sampled[j] == draft[j]:
        j += 1
    return j
