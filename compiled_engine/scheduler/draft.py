"""The step being planned: what the decode and prefill planners add to it, in plan order."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_engine.scheduler.plan import DraftAsk, ReqStep, SlotWrite, TierLoad, TokenWrite
from compiled_engine.scheduler.request import Request


@dataclass(slots=True)
class StepDraft:
    step: int
    reqs: list[ReqStep] = field(default_factory=list)
    members: list[Request] = field(default_factory=list)  # the ledger entry of each ReqStep
    slot_writes: list[SlotWrite] = field(default_factory=list)
    token_writes: list[TokenWrite] = field(default_factory=list)
    draft_asks: list[DraftAsk] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)

    def add(self, req: Request, step: ReqStep, write: SlotWrite) -> None:
        self.reqs.append(step)
        self.members.append(req)
        self.slot_writes.append(write)
        req.last_step = self.step
