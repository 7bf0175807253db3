"""Structured output: JSON schemas, regular expressions, choices and EBNF grammars enforced token by
token with xgrammar (the grammar engine vLLM and SGLang use; it runs on the CPU).

A `GrammarBook` serves one tokenizer: it compiles each constraint once (xgrammar's compiler caches
by the constraint's text) and gives each request a `RequestGrammar`, whose matcher fills the token
mask of the request's next step and advances when one of its tokens commits. The sampler applies the
mask after every other rule (logit_bias, penalties, logits processors), so no rule can bring back a
token the grammar excludes, and log-probabilities are those of the masked distribution. The
request's own stop_token_ids are allowed wherever the grammar allows its EOS (where the document may
end). xgrammar is imported on the first constrained request: it costs seconds to import.

`compile_async` compiles on a thread of its own (xgrammar releases the GIL, so steps go on): the
served engine holds a constrained request out of its steps until its grammar is ready
(`ranks.grammar_wait`), then hands the compiled grammar to `for_request`. The compiler's cache (by
the constraint's text, bounded in bytes) serves the next request with the same constraint.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from compiled_engine.sampling_params import StructuredOutput

ANY_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
CACHE_BYTES = 512 * 2**20  # compiled grammars kept by the compiler (LRU)


class ConstraintError(ValueError):
    """A constraint that does not compile (a bad schema, regex or grammar): the request's 400."""


class GrammarBook:
    def __init__(self, tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        """`tokenizer`: loads the Hugging Face tokenizer (called once, on the first constrained
        request); `vocab_size`: the model's (the logits' width); `stop_token_ids`: the ids that end
        a request (None: the tokenizer's EOS); `cache_bytes`: the compiler's cache (0: none)."""
        self._load_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = None if stop_token_ids is None else list(stop_token_ids)
        self.cache_bytes = cache_bytes
        self._compiler = None
        self._info = None
        self._json_mask: torch.Tensor | None = None
        self._lock = threading.RLock()
        # compiles running on their threads (one per constraint; the same constraint shares one)
        self._compiling: dict[StructuredOutput, Future] = {}
        self._compiling_lock = threading.Lock()

    def compile_async(self, spec: StructuredOutput) -> Future:
        """Compile `spec` on a daemon thread; the future's result is the compiled grammar (for
        `for_request`), its exception the ConstraintError of a bad constraint."""
        with self._compiling_lock:
            future = self._compiling.get(spec)
            if future is None:
                future = self._compiling[spec] = Future()
                threading.Thread(target=self._compile_into, args=(spec, future),
                                 name="grammar", daemon=True).start()
            return future

    def _compile_into(self, spec: StructuredOutput, future: Future) -> None:
        try:
            result, error = self.compile(spec), None
            if spec.kind == "json":
                self._no_control_characters()  # built once, here rather than at admission
        except BaseException as e:  # the future carries it to the request
            result, error = None, e
        with self._compiling_lock:
            del self._compiling[spec]
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`; ConstraintError saying what is wrong with it."""
        compiler = self._get_compiler()
        try:
            # compact JSON: no runs of whitespace a weak model could fill its budget with
            if spec.kind == "json":
                schema = _json_schema_text(spec.spec) if spec.spec else ANY_OBJECT
                return compiler.compile_json_schema(
                    schema, any_whitespace=False, strict_mode=spec.strict
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.spec))
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ConstraintError(f"invalid {spec.kind} constraint: {_first_line(e)}") from None

    def for_request(
        self, spec: StructuredOutput, stop_token_ids: Sequence[int] = (), compiled=None
    ) -> RequestGrammar:
        """A matcher for one request; `stop_token_ids`: the request's own, allowed where the EOS
        is; `compiled`: `spec`'s compiled grammar when it was compiled ahead (else compiled
        here)."""
        import xgrammar as xgr

        extra = self._no_control_characters() if spec.kind == "json" else None
        grammar = compiled if compiled is not None else self.compile(spec)
        return RequestGrammar(xgr.GrammarMatcher(grammar), self.vocab_size, extra, stop_token_ids)

    def _no_control_characters(self) -> torch.Tensor:
        """The tokens without a control character (U+0000-U+001F), and the stop tokens, as a packed
        mask. xgrammar's JSON strings admit raw control characters, which JSON does not (json.loads
        rejects them); compact JSON needs none outside strings, so JSON constraints also apply this
        mask."""
        with self._lock:
            if self._json_mask is None:
                self._get_compiler()
                info = self._info
                stops = set(info.stop_token_ids)
                allowed = _token_set((), self.vocab_size)
                for i, piece in enumerate(info.decoded_vocab[: self.vocab_size]):
                    allowed[i] = i in stops or (bool(piece) and min(piece) >= 0x20)
                self._json_mask = _packed(allowed)
            return self._json_mask

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(
                    self._info, max_threads=1, cache_enabled=self.cache_bytes > 0,
                    cache_limit_bytes=self.cache_bytes or -1,
                )
            return self._compiler


class RequestGrammar:
    """One request's matcher: the state after the tokens it has committed. `extra`: a packed mask of
    tokens allowed on top of the grammar's (None: all); `stop_token_ids`: the request's own stop
    tokens, allowed wherever the document is complete (as the EOS)."""

    def __init__(self, matcher, vocab_size: int, extra: torch.Tensor | None = None,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._extra = extra
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = _packed(_token_set(self._stop_ids, vocab_size)) if self._stop_ids else None

    def next_mask(self) -> torch.Tensor:
        """The allowed next tokens as a packed bitmask: int32 [ceil(vocab / 32)], bit t % 32 of word
        t // 32."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        mask = mask[0] if self._extra is None else mask[0] & self._extra
        return mask | self._stops if self._stops is not None and self.complete else mask

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar does not allow it (one of the
        request's own stop tokens is allowed after a complete document: the request ends on it)."""
        if token in self._stop_ids and self.complete:
            return True
        return bool(self._matcher.accept_token(token))

    def allowed_prefix(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The longest prefix of `tokens` (draft tokens) the grammar accepts from its state, up to a
        complete document; the matcher is left as it was."""
        n = 0
        for token in tokens:
            if self.complete or not self._matcher.accept_token(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return tuple(tokens[:n])

    def masks_along(self, tokens: Sequence[int]) -> list[tuple[torch.Tensor, bool]]:
        """(`next_mask()`, `complete`) now and after each of `tokens` (drafts from
        `allowed_prefix`): one per position a verify step samples at; the matcher is left as it
        was."""
        out = [(self.next_mask(), self.complete)]
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise ValueError(f"draft token {token} is not allowed by the grammar")
            out.append((self.next_mask(), self.complete))
        if tokens:
            self._matcher.rollback(len(tokens))
        return out

    @property
    def complete(self) -> bool:
        """The output so far is a whole document: only a stop token may follow."""
        return bool(self._matcher.is_completed())

    @property
    def terminated(self) -> bool:
        """A stop token was accepted after a complete document: the request is over."""
        return bool(self._matcher.is_terminated())


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def packed_tokens(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A packed bitmask (`RequestGrammar.next_mask`'s layout) allowing `ids` only."""
    return _packed(_token_set(ids, vocab_size))


@functools.cache
def every_token(vocab_size: int) -> torch.Tensor:
    """A packed bitmask allowing the whole vocabulary (shared: not to be written)."""
    allowed = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.bool)
    allowed[:vocab_size] = True
    return _packed(allowed)


def _token_set(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """bool [ceil(vocab / 32) * 32]: True at `ids` (those outside the vocabulary are left to the
    scheduler's check of the request, which rejects them by name)."""
    allowed = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.bool)
    allowed[[i for i in ids if 0 <= i < vocab_size]] = True
    return allowed


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """A bool [n * 32] tensor as a packed bitmask (xgrammar's layout): int32 [n], bit t % 32 of word
    t // 32."""
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _json_schema_text(schema: str) -> str:
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"the schema is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("a JSON schema is an object")
    return schema


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
