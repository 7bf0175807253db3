"""What a request gathers at its prompt positions, chunk by chunk, until its first event carries it:
the prompt tokens' log-probs, or (an embedding request) the final hidden states it pools."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_engine.runner.prompt_outputs import KeptRows
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import PromptLogprob, ReqStep


@dataclass(slots=True)
class PromptRecord:
    prompt_len: int
    top: int | None  # the request's prompt_logprobs (None: not asked)
    pooling: str | None  # "last" | "mean" (None: not an embedding request)
    # [p]: the log-prob of prompt token p + 1 given the tokens before it, once computed
    logprobs: list[PromptLogprob | None] = field(default_factory=list)
    chunks: dict[int, torch.Tensor] = field(default_factory=dict)  # start -> hidden states

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_len: int) -> PromptRecord | None:
        if params.prompt_logprobs is None and params.pooling is None:
            return None
        return cls(prompt_len, params.prompt_logprobs, params.pooling,
                   [None] * max(prompt_len - 1, 0))

    def wanted(self, step: ReqStep, index: int) -> KeptRows | None:
        """What to keep of a prefill chunk (`index`: its place in the plan), None for nothing."""
        end = step.start + step.length
        num_logprobs = 0
        if self.top is not None:
            num_logprobs = max(0, min(end, self.prompt_len - 1) - step.start)
        hidden = self.pooling == "mean" or (self.pooling == "last" and end == self.prompt_len)
        if not num_logprobs and not hidden:
            return None
        return KeptRows(index, num_logprobs, self.top or 0, hidden)

    def add(
        self, step: ReqStep, logprobs: list[PromptLogprob], hidden: torch.Tensor | None
    ) -> None:
        """Fold in one chunk's outputs. A chunk at position 0 starts over (a request retracted
        before its first token recomputes its prompt)."""
        self.logprobs[step.start : step.start + len(logprobs)] = logprobs
        if hidden is not None:
            if step.start == 0 or self.pooling == "last":
                self.chunks.clear()
            self.chunks[step.start] = hidden

    def deliver(self) -> dict:
        """The fields of the request's first event."""
        return {"prompt_logprobs": self.prompt_logprobs(), "embedding": self.embedding()}

    def prompt_logprobs(self) -> list[PromptLogprob] | None:
        if self.top is None:
            return None
        missing = [p + 1 for p, lp in enumerate(self.logprobs) if lp is None]
        assert not missing, f"prompt log-probs missing at positions {missing[:8]}"
        return list(self.logprobs)  # type: ignore[arg-type]

    def embedding(self) -> list[float] | None:
        """The pooled final hidden state, L2-normalized, in float32. The mean is taken over the
        whole prompt's states at once, so it does not depend on how the prompt was chunked."""
        if self.pooling is None:
            return None
        if self.pooling == "last":
            (states,) = self.chunks.values()
            vector = states[-1].float()
        else:
            starts = sorted(self.chunks)
            states = torch.cat([self.chunks[s] for s in starts])
            assert starts[0] == 0 and len(states) == self.prompt_len, "prompt states missing"
            vector = states.float().mean(dim=0)
        return torch.nn.functional.normalize(vector, dim=0).tolist()
