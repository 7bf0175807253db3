"""What the engine keeps about one request, as components of its ledger entry (`Request.hooks`):
sampling state (generator, min_tokens bans, token history), grammar (structured output), drafter
(speculative decoding) and prompt record (prompt log-probs, embeddings). Each answers for its
feature: the sampler's rows of a step, what to keep of its prompt positions, the verdict on a
token, the fields of its first event. `RequestFeatures` makes them from a request's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_engine.constraints import GrammarBook, RequestGrammar
from compiled_engine.jax import bridge
from compiled_engine.kv_tier.tier import HostPages
from compiled_engine.prompt_record import PromptRecord
from compiled_engine.reasoning_gate import ReasoningGate
from compiled_engine.runner.prompt_outputs import KeptRows
from compiled_engine.runner.sampler import SamplingRow, needs_history
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import ReqStep, StepPlan
from compiled_engine.scheduler.request import Request, TokenRejected
from compiled_engine.scheduler.validation import RequestRejected
from compiled_engine.speculative.config import SpeculativeConfig
from compiled_engine.speculative.draft_model import DraftModel, DraftModelDrafter
from compiled_engine.speculative.ngram import NgramDrafter

Drafter = NgramDrafter | DraftModelDrafter


@dataclass(slots=True, weakref_slot=True)  # tests check that nothing holds it once its request ends
class RequestState:
    """One request's `RequestHooks`: it ends with its ledger entry, no other registry holds it."""

    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...]  # EOS / stop ids, masked while fewer than min_tokens were generated
    grammar: RequestGrammar | ReasoningGate | None = None  # structured output, a thinking span
    drafter: Drafter | None = None  # speculative decoding: proposes the request's drafts
    # prompt log-probs / an embedding's hidden states, until its first event carries them away
    prompt: PromptRecord | None = None
    # the KV tier: prompt pages read for it while it waited (`LedgerParams.host_pages`)
    host_kv: HostPages | None = None
    logprobs: int | None = field(init=False)  # RequestHooks: the params' logprobs
    history: bool = field(init=False)  # the sampler reads its token history (penalties, processors)

    def __post_init__(self) -> None:
        self.logprobs = self.params.logprobs
        self.history = needs_history(self.params)

    # ---- RequestHooks -------------------------------------------------------------------------
    def on_token(self, token: int) -> bool:
        if not self.grammar.accept(token):
            what = (f"the {self.params.structured.kind} constraint"
                    if self.params.structured is not None else "the thinking token budget")
            raise TokenRejected(
                f"structured output: token {token} was sampled, which {what} does not allow (were "
                "all the tokens it allows ruled out, by logit_bias or a logits processor?)"
            )
        return self.grammar.terminated

    def first_event(self) -> dict[str, object]:
        prompt, self.prompt = self.prompt, None
        return {} if prompt is None else prompt.deliver()

    # ---- the step -----------------------------------------------------------------------------
    def add_sampling_rows(self, step: ReqStep, prompt_len: int, rows: list[SamplingRow]) -> None:
        """Append the sampler's rows of this step to `rows`, one per token drawn (a verify step:
        one per verified position): bans until min_tokens, the grammar's token mask, where the
        token history lies in the token table (penalties, logits processors), the position of the
        token drawn."""
        params = self.params
        first = step.start + step.length - step.num_sampled  # position of the first sampling row
        masks = self.grammar.masks_along(step.draft) if self.grammar is not None else None
        for j in range(step.num_sampled):
            seq_len = first + j + 1
            banned = self.banned if seq_len - prompt_len < params.min_tokens else ()
            mask = None
            if masks is not None:
                mask, complete = masks[j]
                if complete:
                    banned = ()  # a complete document ends now, min_tokens or not
            rows.append(SamplingRow(params, self.generator, banned, token_mask=mask,
                                    history=(step.row, prompt_len, seq_len) if self.history
                                    else None, position=seq_len))

    def kept_rows(self, step: ReqStep, index: int, req: Request) -> KeptRows | None:
        """What a prefill chunk (`index`: its place in the plan) keeps for the prompt record."""
        if self.prompt is None or req.output or step.start >= len(req.prompt):
            return None
        return self.prompt.wanted(step, index)

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to k drafts after the request's known tokens, cut where its grammar would reject
        them."""
        if self.drafter is None:
            return ()
        drafts = self.drafter.propose(req, k)
        if drafts and self.grammar is not None:
            drafts = self.grammar.allowed_prefix(drafts)
        return drafts


@dataclass(slots=True)
class RequestFeatures:
    """Makes each request's `RequestState` from its sampling parameters."""

    eos_token_ids: tuple[int, ...]
    device: torch.device
    grammars: GrammarBook | None = None  # structured output (None: no tokenizer, no constraints)
    speculative: SpeculativeConfig | None = None
    draft_model: DraftModel | None = None  # speculative method draft_model

    def state(self, rid: str, params: SamplingParams, prompt_len: int,
              compiled_grammar=None) -> RequestState:
        """RequestRejected (a ValueError) naming the first bad sampling parameter, a logits
        processor that cannot be imported, or a constraint that does not compile
        (`compiled_grammar`: compiled ahead)."""
        check_sampling(rid, params)
        grammar = None
        gated = params.structured is not None or params.thinking is not None
        if gated and self.grammars is None:
            raise RequestRejected(
                f"request {rid!r}: this engine serves no structured output and no thinking "
                "budget (no tokenizer)"
            )
        if params.structured is not None:
            grammar = self.grammars.for_request(params.structured, params.stop_token_ids,
                                                compiled_grammar)
        if params.thinking is not None:
            span, vocab = params.thinking, self.grammars.vocab_size
            if max(span.start_token, span.end_token) >= vocab:
                raise RequestRejected(f"request {rid!r}: the thinking span's tokens are outside "
                                      f"the vocabulary [0, {vocab})")
            grammar = ReasoningGate(params.thinking, grammar, self.grammars.vocab_size)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        banned = (
            tuple(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)))
            if params.min_tokens
            else ()
        )
        return RequestState(params, generator, banned, grammar, self._drafter(params),
                            PromptRecord.for_request(params, prompt_len))

    def _drafter(self, params: SamplingParams) -> Drafter | None:
        """A request's drafter; none with logits processors (a processor's error at a draft's
        position would end a request that never reaches that position)."""
        spec = self.speculative
        if spec is None or params.logits_processors:
            return None
        if self.draft_model is not None:
            return self.draft_model.drafter()
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)


def check_sampling(rid: str, params: SamplingParams) -> None:
    """RequestRejected naming the first bad sampling parameter, or a logits processor name that
    cannot be imported (before anything is queued). The ledger checks its own fields."""
    try:
        params.validate()
        for processor in params.logits_processors:
            bridge.resolve(processor)
    except ValueError as e:
        raise RequestRejected(f"request {rid!r}: {e}") from None


def propose_drafts(plan: StepPlan) -> list[tuple[int, ...]]:
    """The drafts of each decode the plan asks them for (`StepPlan.draft_asks`), each by its
    request's own drafter."""
    drafts = []
    for ask in plan.draft_asks:
        req = plan.members[ask.index]
        drafts.append(req.hooks.propose(req, ask.k))
    return drafts
