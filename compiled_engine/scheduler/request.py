"""A request's entry in the ledger: a few lengths, its table row, its prefix lock, its finish
rules."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from compiled_engine.scheduler.speculation import SpecStats


@dataclass(frozen=True, slots=True)
class LedgerParams:
    """What the ledger schedules and finishes a request by (the rest of its sampling parameters stay
    with the engine: `compiled_engine.sampling_params.SamplingParams.ledger_params`)."""

    max_tokens: int = 16
    min_tokens: int = 0  # stop ids do not end the request before this many generated tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # structured output: planned only once its previous token is committed
    constrained: bool = False
    # Every prompt position is computed: admitted without a prefix-cache hit until it has an output
    # token (prompt log-probs, mean-pooled embeddings need each position's outputs).
    every_position: bool = False
    # LoRA: the engine's id of the request's adapter (0: the base model). Its prefix-cache entries
    # are its own: the same tokens under another adapter have other KV.
    adapter: int = 0
    # vLLM's `cache_salt`, as its namespace (`salt_namespace`; 0: no salt): its prefix-cache entries
    # are shared only with requests of the same salt.
    cache_salt: int = 0
    # The KV tier: the prompt's pages [first, end) whose KV the engine holds on the host (read from
    # the tier while the request waited). Admitted with a cache hit of at least `first` pages, the
    # request gets them loaded instead of computed.
    host_pages: tuple[int, int] = (0, 0)
    # priority scheduling (SchedulerConfig.policy "priority"): lower is sooner (vLLM's meaning)
    priority: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for ok, message, value in (
            (self.max_tokens >= 0, "max_tokens must be >= 0", self.max_tokens),
            (self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens),
            (
                self.min_tokens <= self.max_tokens,
                "min_tokens must be <= max_tokens",
                self.min_tokens,
            ),
            (self.adapter >= 0, "adapter must be >= 0", self.adapter),
            (0 <= self.cache_salt < 1 << SALT_BITS, "cache_salt must be a salt_namespace",
             self.cache_salt),
            (
                0 <= self.host_pages[0] <= self.host_pages[1],
                "host_pages must be 0 <= first <= end",
                self.host_pages,
            ),
            (
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be >= 0",
                self.stop_token_ids,
            ),
        ):
            if not ok:
                raise ValueError(f"{message}, got {value!r}")


# A prefix-cache key is a token id (below 2**32) with its request's namespace in the high bits:
# its adapter's id from bit ADAPTER_SHIFT, its cache salt's namespace from bit SALT_SHIFT. The same
# tokens under another adapter or salt are other keys, so no prefix is shared across them.
ADAPTER_SHIFT = 32
SALT_SHIFT = 64
SALT_BITS = 128


def salt_namespace(salt: str | None) -> int:
    """The namespace of vLLM's `cache_salt` (0: no salt): 128 bits of its SHA-256."""
    if salt is None:
        return 0
    digest = hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[: SALT_BITS // 8], "big") or 1


def cache_key_tokens(tokens: Sequence[int], adapter: int, salt: int = 0) -> tuple[int, ...]:
    """`tokens` as the prefix cache keys them under `adapter` (0: the base model) and cache salt
    namespace `salt` (0: none)."""
    high = adapter << ADAPTER_SHIFT | salt << SALT_SHIFT
    if not high:
        return tuple(tokens)
    return tuple(high | t for t in tokens)


def split_cache_key(path: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
    """A prefix-cache path's adapter, salt namespace and token ids (`cache_key_tokens` undone)."""
    high = path[0] >> ADAPTER_SHIFT if path else 0
    if not high:
        return 0, 0, tuple(path)
    mask = (1 << ADAPTER_SHIFT) - 1
    adapter = high & ((1 << (SALT_SHIFT - ADAPTER_SHIFT)) - 1)
    return adapter, high >> (SALT_SHIFT - ADAPTER_SHIFT), tuple(t & mask for t in path)


class TokenRejected(Exception):
    """A constrained request drew a token its constraint does not allow: it fails (the message says
    why) and the token is dropped."""


class RequestHooks(Protocol):
    """What the engine hangs off a ledger entry (sampling state, grammar, prompt record): the commit
    asks it about the request's tokens, so that one place ends requests and makes their events."""

    logprobs: int | None  # top log-probs wanted with each token (0: the token's own; None: none)

    def on_token(self, token: int) -> bool:
        """A constrained request's next token (`LedgerParams.constrained`): True when it completes
        the request's document; raises TokenRejected."""

    def first_event(self) -> dict[str, object]:
        """Fields of the request's first event (`TokenEvent`'s prompt log-probs, embedding)."""


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted: it recomputes prompt + generated tokens)
    RUNNING = "running"  # holds a table row, pages and one prefix-cache lock
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    prompt: tuple[int, ...]
    params: LedgerParams
    max_len: int  # prompt + max_tokens, capped by the context limit and the KV pool
    stop_ids: frozenset[int]  # EOS ids (unless ignore_eos) and stop_token_ids
    output: list[int] = field(default_factory=list)  # committed generated tokens
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Lengths: positions [0, planned_len) have their KV planned; [0, device_len) have a token on the
    # device (committed or sampled by an in-flight step). 0 <= planned_len <= device_len <= max_len.
    planned_len: int = 0
    device_len: int = 0
    fill_to: int = 0  # prefill (or recompute after retraction) target set at admission
    row: int = -1
    pages: list[int] = field(default_factory=list)  # page of each page_size positions
    lock: object | None = None  # prefix-cache handle held while running
    prefix_pages: int = 0  # pages[:prefix_pages] belong to the prefix cache; the rest are private
    last_step: int = -1  # last planned step that includes this request
    rewrite: tuple[int, int] | None = None  # page-table positions [lo, hi) to rewrite next step
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's acceptance
    adapter_slot: int = -1  # LoRA: the device slot of its adapter while it runs (-1: none)
    # prompt tokens its first admission did not compute: the pool's and the KV tier's (-1: not yet)
    cached_tokens: int = -1
    host_loaded: bool = False  # its host pages were loaded (once: the engine then drops them)
    arrival: int = 0  # its place in the order requests were added
    arrival_step: int = 0  # the step planned next when it was added (priority scheduling's aging)
    # Everything the engine keeps about the request (its sampling parameters, generator, grammar),
    # gone with this entry however the request ends (one record, one finish path).
    hooks: RequestHooks | None = None

    @property
    def known_len(self) -> int:
        """Tokens known on the host."""
        return len(self.prompt) + len(self.output)

    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    def cache_tokens(self) -> tuple[int, ...]:
        """Its tokens as the prefix cache keys them: under an adapter or a cache salt each id
        carries their namespace in its high bits (`cache_key_tokens`), so that no prefix is shared
        across adapters or salts."""
        return cache_key_tokens(self.tokens(), self.params.adapter, self.params.cache_salt)

    def slots(self, page_size: int, lo: int, hi: int) -> tuple[int, ...]:
        """KV slots of positions [lo, hi) (on its pages)."""
        pages = self.pages
        if page_size == 1:
            return tuple(pages[lo:hi])
        return tuple(pages[p // page_size] * page_size + p % page_size for p in range(lo, hi))
