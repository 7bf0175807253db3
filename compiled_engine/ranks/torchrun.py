"""Where this process sits in a torchrun job (TP across hosts): torchrun's environment names the
rank, the world and this host's share of it; the ranks rendezvous through `env://`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TorchrunPlacement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_placement(env: Mapping[str, str] = os.environ) -> TorchrunPlacement | None:
    """This process's place in a torchrun job, or None outside one."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return TorchrunPlacement(
        rank,
        world,
        int(env.get("LOCAL_RANK", rank)),
        int(env.get("LOCAL_WORLD_SIZE", world)),
    )
