"""Per-request sampling parameters and finish rules (plain data, stdlib only), validated by the
engine that admits the request (`request_state.check_sampling`; at tp > 1 also by `RemoteEngine`,
which must answer before the request leaves the process), `n` when it is expanded (`expand_n`). The
ledger keeps only what it schedules by (`ledger_params`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from compiled_engine.scheduler.request import LedgerParams, salt_namespace

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
POOLINGS = ("last", "mean")  # an embedding's pooling of the final hidden states
MAX_CACHE_SALT_CHARS = 1024  # vLLM's cache_salt: a random secret (43 base64 characters: 256 bits)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token (`compiled_engine.constraints`):
        json     `spec` a JSON schema (text); "" for any JSON object
                 (`response_format: json_object`)
        regex    `spec` a regular expression the whole output matches
        choice   `spec` the allowed outputs (a tuple of strings): exactly one of them
        grammar  `spec` an EBNF grammar (GBNF, as llama.cpp and xgrammar write it; `root` is the
                 start)
    `strict` (json only): True, only the properties and array items the schema names (xgrammar's
    strict mode, as vLLM and SGLang compile every schema); False, any document the schema validates
    (extra properties where the schema does not forbid them). The request ends when the constraint
    is complete (or at max_tokens, with "length")."""

    kind: str
    spec: str | tuple[str, ...]
    strict: bool = True

    def validate(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}",
            self.kind,
        )
        if self.kind == "choice":
            ok = (
                isinstance(self.spec, tuple)
                and bool(self.spec)
                and all(isinstance(c, str) and c for c in self.spec)
            )
            _check(ok, "choice must be a non-empty list of non-empty strings", self.spec)
        else:
            _check(isinstance(self.spec, str), f"a {self.kind} constraint is a string", self.spec)
        _check(
            isinstance(self.strict, bool), "structured output strict must be a boolean", self.strict
        )


@dataclass(frozen=True, slots=True)
class ThinkingSpan:
    """A reasoning model's thinking span (`<think>` ... `</think>`, each one token) in the output,
    for what acts on the answer only (`compiled_engine.reasoning_gate`): the structured output
    applies after the span, and `budget` (thinking tokens; None: no limit) ends the span by forcing
    `end_token`. `opened`: the prompt opened the span (the output starts inside it); else the
    output's first token may open it."""

    start_token: int
    end_token: int
    opened: bool
    budget: int | None = None

    def validate(self) -> None:
        _check(all(isinstance(t, int) and t >= 0 for t in (self.start_token, self.end_token))
               and self.start_token != self.end_token,
               "the thinking span's tokens must be two token ids", self)
        _check(self.budget is None or (isinstance(self.budget, int) and 0 <= self.budget < 2**31),
               "thinking_token_budget must be an integer in [0, 2**31)", self.budget)


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric field's allowed values: [lo, hi], or (lo, hi] with `lo_open`."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, value: float) -> bool:
        return (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi

    def __str__(self) -> str:
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


# The one table of the sampling fields' ranges: the engine validates by it
# (`SamplingParams.validate`) and the server parses request bodies by it (`server.protocol`).
# top_k -1 and 0: off; logprobs and prompt_logprobs may also be None (none wanted: OPTIONAL).
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, 2**31 - 1),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 100.0, lo_open=True),
    "n": Range(1, 64),
    "logprobs": Range(0, 20),  # top alternatives per token (vLLM's default max_logprobs)
    "prompt_logprobs": Range(0, 20),
    "priority": Range(-(2**31), 2**31 - 1),
}
OPTIONAL = frozenset({"logprobs", "prompt_logprobs"})
# A logit_bias value over the API (OpenAI's range); offline any bias is allowed, -inf included.
LOGIT_BIAS_RANGE = Range(-100.0, 100.0)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    # the prompt tokens' log-probs (each given the tokens before it), with this many alternatives
    prompt_logprobs: int | None = None
    # "last" | "mean": an embedding request (max_tokens 0): its final event carries the final hidden
    # state of its last prompt token, or the mean over its prompt, L2-normalized
    pooling: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # priority scheduling (`--scheduling-policy priority`): lower is sooner, as vLLM's
    priority: int = 0
    # vLLM's cache_salt: a request shares prefix-cache and KV-tier pages only with requests of the
    # same salt (None: with those of no salt)
    cache_salt: str | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings: matched by the server's detokenizer
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    n: int = 1
    # constrained decoding (JSON schema, regex, choice, grammar)
    structured: StructuredOutput | None = None
    # a reasoning model's thinking span: the structured output starts after it; its token budget
    thinking: ThinkingSpan | None = None
    # JAX functions f(token_ids, logits) -> logits, or their names "module:function" (at tp_size >
    # 1), applied in order after logit_bias and the penalties, before the structured-output mask
    # (`compiled_engine.jax.bridge`); offline API only
    logits_processors: tuple[Callable | str, ...] = ()

    def ledger_params(self) -> LedgerParams:
        return LedgerParams(
            self.max_tokens,
            self.min_tokens,
            tuple(self.stop_token_ids),
            self.ignore_eos,
            self.structured is not None or self.thinking is not None,
            self.prompt_logprobs is not None or self.pooling == "mean",
            priority=self.priority,
            # a salt that is not a string is refused by `validate`
            cache_salt=salt_namespace(self.cache_salt) if isinstance(self.cache_salt, str) else 0,
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field of those the engine samples by; the ledger
        checks its own (`ledger_params`: lengths and stop ids) when it admits the request
        (`check_request`)."""
        for name, allowed in SAMPLING_RANGES.items():
            _check_range(name, getattr(self, name), allowed)
        _check(self.pooling is None or self.pooling in POOLINGS,
               "pooling must be 'last' or 'mean'", self.pooling)
        _check(self.pooling is None or self.max_tokens == 0,
               "an embedding request (pooling) generates nothing: max_tokens must be 0",
               self.max_tokens)
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)", self.seed)
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str)
                                           and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
               f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
               "characters", self.cache_salt)
        if self.logit_bias is not None:
            _check(
                all(t >= 0 for t in self.logit_bias),
                "logit_bias token ids must be >= 0",
                self.logit_bias,
            )
        if self.structured is not None:
            self.structured.validate()
        if self.thinking is not None:
            self.thinking.validate()
        _check(
            isinstance(self.logits_processors, tuple | list)
            and all(
                callable(f) or (isinstance(f, str) and ":" in f) for f in self.logits_processors
            ),
            "logits_processors must be a list of functions f(token_ids, logits) -> logits or "
            "'module:function' names",
            self.logits_processors,
        )


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """A request's `n` samples as `n` single-sample requests (ValueError for a bad `n` or `seed`;
    the engine validates the rest when it admits each); sample i of a seeded request uses seed + i
    (mod 2**63, the range of torch's generators)."""
    _check_range("n", params.n, SAMPLING_RANGES["n"])
    _check(
        params.seed is None or 0 <= params.seed < 2**63, "seed must be in [0, 2**63)", params.seed
    )
    seeds = [None if params.seed is None else (params.seed + i) % 2**63 for i in range(params.n)]
    return [replace(params, n=1, seed=seed) for seed in seeds]


def _check_range(name: str, value: object, allowed: Range) -> None:
    if value is None and name in OPTIONAL:
        return
    integer = isinstance(allowed.lo, int) and isinstance(allowed.hi, int)
    kind = int if integer else int | float
    number = isinstance(value, kind) and not isinstance(value, bool)
    _check(number and value in allowed,
           f"{name} must be {'an integer ' if integer else ''}{allowed}", value)


def _check(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
