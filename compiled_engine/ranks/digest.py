"""TP debug mode: every rank hashes each iteration's plan and committed tokens, the digests are
gathered on the control group, and any difference stops the engine with the step where the ranks
diverged."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from compiled_engine.scheduler.plan import StepPlan, TokenEvent

ENV_FLAG = "COMPILED_ENGINE_TP_DEBUG"


class LedgerDivergence(RuntimeError):
    pass


def debug_enabled(config_flag: bool) -> bool:
    return config_flag or os.environ.get(ENV_FLAG, "") not in ("", "0")


def ledger_digest(step: int, plan: StepPlan | None, events: list) -> int:
    """A 63-bit hash of the plan (request order, positions, KV slots, page-table writes) and the
    tokens."""
    tokens = [
        (e.rid, e.token, e.finished, e.finish_reason) for e in events if isinstance(e, TokenEvent)
    ]
    text = repr((step, plan, tokens)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def check_digests(step: int, digests: list[int]) -> None:
    if len(set(digests)) > 1:
        by_rank = ", ".join(f"rank {r}: {d:016x}" for r, d in enumerate(digests))
        raise LedgerDivergence(
            f"TP ranks diverged at engine step {step}: the plan or the sampled tokens differ "
            f"({by_rank})"
        )


def compare_across_ranks(step: int, digest: int, group: dist.ProcessGroup) -> None:
    """Collective on `group`: every rank calls it once per loop iteration."""
    mine = torch.tensor([digest], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    check_digests(step, [int(t.item()) for t in gathered])
