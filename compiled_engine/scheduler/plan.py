"""The plain-data plan a scheduler step hands to the runner, and what a commit hands back."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ReqStep:
    rid: str
    row: int  # table row of the request (0 <= row < max_rows)
    start: int  # first position computed this step
    length: int  # tokens computed: positions start .. start+length-1 (>= 1)
    out_slots: tuple[int, ...]  # KV slot written by each computed token (len == length)
    sample: bool  # sample a token from the logits of the last computed position
    sampling: SamplingParams


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
class Batch:
    step: int  # increasing step id
    reqs: tuple[ReqStep, ...]  # in a deterministic order
    slot_writes: tuple[SlotWrite, ...]
    token_writes: tuple[TokenWrite, ...]
    is_decode: bool  # every req computes exactly 1 token (decode-only step)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One output of ``Scheduler.commit``: a new token and/or the end of a request."""

    rid: str
    token: int | None  # None: the request ended without a new token (e.g. max_tokens=0)
    finished: bool
    finish_reason: str | None  # "stop" | "length" when finished
