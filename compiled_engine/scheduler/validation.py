"""What makes a request impossible to run: checked once, at admission (`Scheduler.add_request`), and
by a client that must answer before the request reaches the ledger (`RemoteEngine`)."""

from __future__ import annotations

from collections.abc import Sequence

from compiled_engine.scheduler.request import LedgerParams


class RequestRejected(ValueError):
    """A request that can never run (bad parameters, empty prompt, too long for context or KV
    pool)."""


def check_request(
    rid: str,
    prompt: Sequence[int],
    params: LedgerParams,
    max_context: int,
    capacity_tokens: int,
    vocab_size: int | None,
    max_loras: int = 0,
    policy: str = "fcfs",
) -> None:
    """Raise RequestRejected naming the first problem: bad ledger parameters (the engine checks the
    sampler's); an empty prompt; token ids the model cannot embed (`vocab_size` None: only negative
    ones); no room for one generated token in the context or in the whole KV pool."""
    try:
        params.validate()
    except ValueError as e:
        raise RequestRejected(f"request {rid!r}: {e}") from None
    if params.adapter and not max_loras:
        raise RequestRejected(f"request {rid!r}: this engine serves no LoRA adapters")
    if params.priority and policy != "priority":
        raise RequestRejected(f"request {rid!r}: got priority {params.priority} but priority "
                              "scheduling is not enabled (--scheduling-policy priority)")
    n = len(prompt)
    if n == 0:
        raise RequestRejected(
            f"request {rid!r}: the prompt is empty (at least one token is needed)"
        )
    if min(prompt) < 0:
        raise RequestRejected(f"request {rid!r}: negative token id {min(prompt)} in the prompt")
    if vocab_size is not None:
        bad = [t for t in prompt if t >= vocab_size]
        if bad:
            raise RequestRejected(
                f"request {rid!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise RequestRejected(
                f"request {rid!r}: stop_token_ids has {bad[0]}, outside the vocabulary"
            )
    if n >= max_context:
        raise RequestRejected(
            f"request {rid!r}: the prompt has {n} tokens but the context limit is {max_context} "
            f"(the prompt must be shorter to leave room for a generated token)"
        )
    if n + 1 > capacity_tokens:
        raise RequestRejected(
            f"request {rid!r}: the prompt has {n} tokens and needs {n + 1} KV slots with one "
            f"generated token, but the whole KV pool holds {capacity_tokens}"
        )
