"""One HTTP request's generation: its sub-requests (prompts x n) in the engine, detokenized
incrementally into per-choice deltas (stop strings cut here, then the engine is told to finish the
request)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from compiled_engine.output_stream import OutputStream
from compiled_engine.sampling_params import SamplingParams, expand_n
from compiled_engine.scheduler.plan import PromptLogprob
from compiled_engine.tokenization import IncrementalDetokenizer
from server.engine_client import EngineClient, EngineRejected
from server.grammar_check import GrammarChecker
from server.metrics import Metrics
from server.request_errors import ProtocolError

T = TypeVar("T")


@dataclass
class Delta:
    """What one choice gained since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # the choice's first delta, when asked


@dataclass
class Choice(OutputStream):
    """The server's one record of a sub-request: what the engine is sent (rid, prompt, parameters)
    and what came back (`OutputStream`), plus the client's view (index, timing)."""

    params: SamplingParams = field(default_factory=SamplingParams)
    index: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    start: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    _sent_tokens: int = 0
    _sent_prompt: bool = False

    def delta(self, text: str) -> Delta:
        lo, self._sent_tokens = self._sent_tokens, len(self.token_ids)
        prompt, self._sent_prompt = (None if self._sent_prompt else self.prompt_logprobs), True
        return Delta(
            self.index,
            text,
            self.token_ids[lo:],
            self.logprobs[lo:],
            self.top_logprobs[lo:],
            self.finish_reason,
            prompt,
        )


@dataclass
class Generation:
    """The choices of one request; `choices[i].index == i`. Prompt j's k-th sample is choice j * n +
    k."""

    request_id: str
    choices: list[Choice]
    prompt_lens: list[int]
    constraint_param: str | None = None  # the request field its output constraint came from

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed (the prefix cache's and the KV tier's): each prompt's first
        sample's."""
        n = len(self.choices) // max(len(self.prompt_lens), 1)
        return sum(c.cached_tokens for c in self.choices[::n]) if n else 0


MAX_LOGPROB_ENTRIES = 1 << 20  # per request: tens of MB of JSON at most


def check_answer_size(prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """400 if the log-probabilities a request asks for (each sampled token's and its alternatives',
    each prompt token's and its alternatives', for each of n samples) could exceed the limit."""
    total, field = 0, "logprobs"
    for ids, p in zip(prompts, params, strict=True):
        if p.logprobs is not None:
            total += p.n * p.max_tokens * (p.logprobs + 1)
        if p.prompt_logprobs is not None:
            total += p.n * len(ids) * (p.prompt_logprobs + 1)
            field = "prompt_logprobs"
    if total > MAX_LOGPROB_ENTRIES:
        raise ProtocolError(
            f"this request could answer {total:,} log-probabilities (n x tokens x (alternatives + "
            f"1), prompts and outputs), more than the server's limit of {MAX_LOGPROB_ENTRIES:,}: "
            "ask for fewer alternatives, tokens or samples", field)


def _until(events: AsyncIterator[T], timeout_s: float | None) -> AsyncIterator[T]:
    """`events` until `timeout_s` has passed, then a 408; without a timeout, `events` itself (no
    extra layer per token)."""
    return events if timeout_s is None else _timed(events, timeout_s)


async def _timed(events: AsyncIterator[T], timeout_s: float) -> AsyncIterator[T]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                event = await anext(events)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ProtocolError(f"the request ran past the server's --request-timeout of "
                                f"{timeout_s:g} s", status=408, code="request_timeout") from None
        yield event


def expand_choices(
    request_id: str,
    tokenizer,
    prompts: list[list[int]],
    params: list[SamplingParams],
    constraint_param: str | None = None,
    lora_name: str | None = None,
) -> Generation:
    """Expand prompts x n into choices, one sub-request each (`expand_n`); `constraint_param` names
    the field of their constraint, for the 400 of one that does not compile in the engine. A request
    whose answer could hold more than MAX_LOGPROB_ENTRIES log-probabilities is a 400 up front."""
    check_answer_size(prompts, params)
    choices = []
    for j, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        for i, sample in enumerate(expand_n(p)):
            detok = IncrementalDetokenizer(tokenizer, ids, p.stop,
                                           keep_stop=p.include_stop_str_in_output)
            choices.append(
                Choice(
                    f"{request_id}-{j * p.n + i}",
                    detok,
                    params=sample,
                    index=len(choices),
                    prompt_ids=ids,
                    lora_name=lora_name,
                )
            )
    return Generation(request_id, choices, [len(ids) for ids in prompts], constraint_param)


async def run(client: EngineClient, gen: Generation, metrics: Metrics,
              timeout_s: float | None = None,
              grammars: GrammarChecker | None = None) -> AsyncIterator[Delta]:
    """Deltas until every choice has finished. Leaving early (disconnect, error) aborts the rest. A
    constraint that does not compile (in `grammars` first, within its budget; else in the engine)
    is a ProtocolError naming its field; a generation still running `timeout_s` after it started, a
    408 ProtocolError."""
    constraint = gen.choices[0].params.structured if gen.choices else None
    if constraint is not None and grammars is not None:
        started = time.monotonic()
        await grammars.check(constraint, gen.constraint_param)
        if timeout_s is not None:  # the request's time includes its constraint's check
            timeout_s = max(0.0, timeout_s - (time.monotonic() - started))
    by_rid = {c.rid: c for c in gen.choices}
    async with client.open(gen.choices) as group:
        try:
            async for ev in _until(group.events(), timeout_s):
                choice = by_rid[ev.rid]
                if ev.token is not None and choice.first_token_at is None:
                    choice.first_token_at = time.monotonic()
                text, stopped = choice.apply(ev)
                if stopped:
                    group.finish(choice.rid)
                if text or choice.finish_reason is not None:
                    yield choice.delta(text)
                if choice.finish_reason is not None:
                    metrics.observe_finished(
                        choice.start, choice.first_token_at, len(choice.token_ids)
                    )
        except EngineRejected as e:
            if e.field != "structured":
                raise
            raise ProtocolError(str(e), gen.constraint_param) from None
