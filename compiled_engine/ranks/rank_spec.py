"""What a rank process is started with (plain data: the launcher, torchrun's entry and the rank share it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compiled_engine.config import EngineConfig


@dataclass(slots=True)
class RankSpec:
    rank: int
    world_size: int
    init_method: str  # torch.distributed rendezvous: tcp://HOST:PORT (launcher) or env:// (torchrun)
    config: EngineConfig
    local_rank: int | None = None  # None: `rank` (one host)
    local_world_size: int | None = None  # None: `world_size`
    heartbeats: Sequence[float] | None = None  # shared with the launcher's monitor: each rank's latest iteration
