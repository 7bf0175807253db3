"""`--speculative-config` / `LLM(speculative=...)`: vLLM's names, checked field by field."""

from __future__ import annotations

from dataclasses import dataclass, fields

from compiled_engine.config import json_object
from compiled_engine.scheduler.speculation import SpecConfig

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix n-grams looked up in the request's own tokens
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 3
    model: str | None = None  # draft_model: a checkpoint with the target's tokenizer
    # the per-request policy (`scheduler.speculation.SpecConfig`)
    min_acceptance: float = 0.3
    acceptance_window: int = 16
    retry_after: int = 32
    # vLLM's name (there: no drafts at all while more requests run); here: while more run, only a
    # request that copies drafts (`copy_accepted`, `scheduler.speculation.SpecConfig`)
    disable_by_batch_size: int = 2
    copy_accepted: float = 4.0
    empty_retry: int = 4  # under overlap: `scheduler.speculation.SpecConfig.empty_retry`

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text; ValueError naming the first bad or unknown field."""
        value = json_object(value, "speculative config", {f.name for f in fields(cls)})
        if value is None:
            return None
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative config needs 'method' and 'num_speculative_tokens'")
        args = dict(value)
        # as vLLM: one of the two alone sets both
        for given, other in (("prompt_lookup_max", "prompt_lookup_min"),
                             ("prompt_lookup_min", "prompt_lookup_max")):
            if given in args and other not in args:
                args[other] = args[given]
        config = cls(**args)
        config.validate()
        return config

    def validate(self) -> None:
        def check(ok: bool, message: str, got: object) -> None:
            if not ok:
                raise ValueError(f"speculative config: {message}, got {got!r}")

        check(self.method in METHODS, f"method must be one of {', '.join(METHODS)}", self.method)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "acceptance_window", "retry_after", "disable_by_batch_size", "empty_retry"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an "
                  "integer", value)
        for name in ("min_acceptance", "copy_accepted"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and not isinstance(value, bool),
                  f"{name} must be a number", value)
        check(self.model is None or isinstance(self.model, str), "model must be a path", self.model)
        check(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1",
              self.num_speculative_tokens)
        check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              "prompt_lookup_min must be in [1, prompt_lookup_max]", self.prompt_lookup_min)
        check(self.method != "draft_model" or isinstance(self.model, str),
              "draft_model needs 'model': the path of a checkpoint", self.model)
        check(self.method == "draft_model" or self.model is None,
              f"'model' is for method draft_model, not {self.method}", self.model)
        self.ledger().validate()

    def ledger(self) -> SpecConfig:
        return SpecConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            min_acceptance=self.min_acceptance,
            window=self.acceptance_window,
            retry_after=self.retry_after,
            max_batch=self.disable_by_batch_size,
            copy_accepted=self.copy_accepted,
            empty_retry=self.empty_retry,
        )
