"""The plan a scheduler step hands to the runner, what the runner hands back, and the events a
commit makes of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compiled_engine.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class ReqStep:
    rid: str
    row: int  # table row of the request (0 <= row < max_rows)
    start: int  # first position computed this step
    length: int  # tokens computed: positions start .. start+length-1 (>= 1)
    out_slots: tuple[int, ...]  # KV slot written by each computed token (len == length)
    sample: bool  # sample a token from the logits of the last computed position
    # Speculative decoding: the draft tokens at positions start+1 .. start+length-1 (a verify step:
    # the request's last token and its drafts, length == 1 + len(draft)); a token is sampled at each
    # of these positions (`scheduler.speculation`).
    draft: tuple[int, ...] = ()
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model)

    @property
    def num_sampled(self) -> int:
        """Tokens sampled for this request in its step: one per verified position."""
        return 1 + len(self.draft) if self.sample else 0


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """Page-table write: ``page_table[row, start:start+len(slots)] = slots``."""

    row: int
    start: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenWrite:
    """Token-table write from the host: ``token_table[row, start:start+len(tokens)] = tokens``."""

    row: int
    start: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """A decode that may carry up to `k` draft tokens after its last token: `reqs[index]` of its
    plan. Its pages are taken; the engine proposes, `Scheduler.add_drafts` puts them in the plan."""

    index: int
    k: int


@dataclass(frozen=True, slots=True)
class TierLoad:
    """Request `rid`'s prompt pages from index `first` on, which the engine holds on the host
    (`LedgerParams.host_pages`), go into `pages` before the step runs: no prefill computes them."""

    rid: str
    first: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int  # increasing step id
    reqs: tuple[ReqStep, ...]  # in a deterministic order
    slot_writes: tuple[SlotWrite, ...]
    token_writes: tuple[TokenWrite, ...]
    is_decode: bool  # every req computes exactly 1 token (decode-only step)
    # the ledger entry of each ReqStep (the engine's and the commit's; the runner reads none)
    members: tuple[Request, ...] = field(default=(), compare=False, repr=False)
    # speculative decoding: the decodes that may carry drafts (none once they are added)
    draft_asks: tuple[DraftAsk, ...] = ()
    # LoRA: (slot, adapter id) to load into the device's adapter slots before this step runs
    adapter_loads: tuple[tuple[int, int], ...] = ()
    # pages of prompts the engine holds on the host (the KV tier): written before this step runs
    tier_loads: tuple[TierLoad, ...] = ()


# A prompt token's log-prob given the tokens before it, its rank in the vocabulary (1: the most
# likely) and the most likely tokens there as (token id, log-prob)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class StepOutput:
    """What the runner hands back for a step: per sampled row (one per `ReqStep.num_sampled`, in
    plan order) its token, log-probs and sampler error, and what the step kept of prompt
    positions."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    errors: dict[int, str] | None = None  # sampled row -> why its request fails
    # per kept prompt position (`KeptRows` order): the next prompt token's log-prob, its rank, the
    # top alternatives
    prompt_logprobs: list[PromptLogprob] | None = None
    hidden: list | None = None  # per `KeptRows.hidden` request: its chunk's states (tensors)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One event for one request: a new token, the end of the request, or both. ``Scheduler.commit``
    makes every one (a stop string's end is the detokenizer's, which needs none), and they go on
    the wire as they are (ranks, server)."""

    rid: str
    token: int | None  # None: the request ended without a new token (e.g. max_tokens=0)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    # the request's first event: its prompt tokens' log-probs (positions 1 ..), when asked
    prompt_logprobs: list[PromptLogprob] | None = None
    embedding: list[float] | None = None  # an embedding request's last event: its vector
    # the first event: prompt tokens taken from the prefix cache or the KV tier, not computed
    cached_tokens: int | None = None
