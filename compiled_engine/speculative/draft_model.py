"""Drafts from a small model with the target's tokenizer, proposed greedily (its argmax: a
point-mass proposal, for which the ledger's acceptance rule is the standard rejection rule).

The draft model runs on a `ModelRunner` of its own (its graphs, its KV tensors, its device tables),
but its KV cache is indexed by the target's KV slots: a request's draft K/V for position p lives in
the slot where the target keeps its K/V for p, in the draft's tensors. The ledger's pages thus serve
both models: no second allocator, and pages given back (rejected drafts, finished requests) are
given back for both. Each request remembers how far its draft KV is valid (`DraftState`): a
proposal first computes the positions after that (an extend step: the prompt at first, then the
tokens the target accepted or corrected), then decodes the drafts one by one.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compiled_engine.models.loader import load_model
from compiled_engine.models.names import resolve_model
from compiled_engine.runner.model_runner import ModelRunner, RunnerConfig
from compiled_engine.runner.sampler import SamplingRow
from compiled_engine.runner.warmup import compile_graphs
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import ReqStep, SlotWrite, StepPlan, TokenWrite
from compiled_engine.scheduler.request import Request

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from compiled_engine.config import EngineConfig
    from compiled_engine.speculative.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class DraftState:
    """One request's draft KV: computed for positions [0, valid) on table row `row` and `pages`,
    since the request's admission that set `fill_to`; `proposed`: the drafts of its last proposal,
    made after position `proposed_at`."""

    row: int = -1
    fill_to: int = -1
    pages: tuple[int, ...] = ()
    valid: int = 0
    proposed: tuple[int, ...] = ()
    proposed_at: int = 0


class DraftModel:
    def __init__(self, runner: ModelRunner, page_size: int) -> None:
        self.runner = runner
        self.page_size = page_size
        self._steps = itertools.count()

    def drafter(self) -> DraftModelDrafter:
        return DraftModelDrafter(self, DraftState())

    def propose(self, req: Request, state: DraftState, k: int) -> tuple[int, ...]:
        """k greedy tokens after the request's known tokens; the request's pages cover every
        position the draft computes (the ledger takes them before it asks)."""
        tokens = req.tokens()
        last = len(tokens) - 1  # the position whose token the first draft follows
        start = min(_valid_len(state, req, tokens, self.page_size), last)
        ps, row = self.page_size, req.row
        drafts: list[int] = []
        lo, hi = start, last + 1
        while len(drafts) < k:
            slots = req.slots(ps, lo, hi)
            plan = StepPlan(
                step=next(self._steps),
                reqs=(ReqStep(req.rid, row, lo, hi - lo, slots, True),),
                slot_writes=(SlotWrite(row, 0, req.slots(ps, 0, hi)),) if lo == start else
                (SlotWrite(row, lo, slots),),
                token_writes=(TokenWrite(row, lo, tokens[lo:hi]),) if lo == start else (),
                is_decode=hi - lo == 1,
            )
            drafts.append(self.runner.execute(plan, [SamplingRow(GREEDY)]).tokens[0])
            lo, hi = hi, hi + 1
        # computed: positions up to `last` (true tokens) and the k - 1 drafts after it
        state.valid = last + k
        state.row, state.fill_to, state.pages = row, req.fill_to, tuple(req.pages)
        state.proposed, state.proposed_at = tuple(drafts), last
        return tuple(drafts)


def _valid_len(state: DraftState, req: Request, tokens: tuple[int, ...], page_size: int) -> int:
    """Positions whose draft KV is still right for the request's tokens, on its current pages: up
    to the first draft of its last proposal that the target did not keep. None after a retraction
    (a new admission), or where a page was replaced (by the prefix cache's copy of it)."""
    if state.row != req.row or state.fill_to != req.fill_to:
        return 0
    at, kept = state.proposed_at, 0
    for draft, token in zip(state.proposed, tokens[at + 1 :]):
        if draft != token:
            break
        kept += 1
    valid = min(state.valid, at + 1 + kept)
    n = -(-valid // page_size)
    return valid if tuple(req.pages[:n]) == state.pages[:n] else 0


@dataclass(slots=True)
class DraftModelDrafter:
    """A request's handle on the engine's draft model (its `RequestState.drafter`)."""

    model: DraftModel
    state: DraftState

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        return self.model.propose(req, self.state, k)


@dataclass(slots=True)
class DraftWeights:
    """The draft checkpoint, loaded before the KV pool is sized (its KV shares the pool's slots)."""

    path: str
    model: torch.nn.Module
    hf_config: PretrainedConfig


def load_draft_weights(spec: SpeculativeConfig, config: EngineConfig, device: torch.device,
                       target_hf: PretrainedConfig) -> DraftWeights:
    """`spec.model` on the target's device, dtype and weight settings; ValueError unless it has the
    served model's vocabulary."""
    path = resolve_model(spec.model)
    model, hf = load_model(path, dtype=config.dtype, device=str(device),
                           quantization=config.quantization)
    if hf.vocab_size != target_hf.vocab_size:
        raise ValueError(
            f"speculative config: the draft model {spec.model!r} has a vocabulary of "
            f"{hf.vocab_size} tokens, the served model {target_hf.vocab_size}: it must share the "
            "served model's tokenizer"
        )
    return DraftWeights(path, model, hf)


def start_draft_model(weights: DraftWeights, config: EngineConfig, target: RunnerConfig,
                      device: torch.device) -> DraftModel:
    """A runner over the target's slot space (a KV pool of as many slots as the target's) for the
    draft weights, its graphs compiled through the compile cache unless eager."""
    runner = ModelRunner(weights.model, dataclasses.replace(target, buckets=[1]), device)
    if not config.enforce_eager:
        compile_graphs(dataclasses.replace(config, model=weights.path), weights.hf_config, runner,
                       None)
    return DraftModel(runner, target.page_size)
