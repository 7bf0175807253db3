"""What a rank process is started with (plain data: the launcher, torchrun's entry and the rank
share it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compiled_engine.config import EngineConfig


@dataclass(slots=True)
class RankSpec:
    rank: int
    world_size: int
    # torch.distributed rendezvous: tcp://HOST:PORT (launcher) or env:// (torchrun)
    init_method: str
    config: EngineConfig
    local_rank: int | None = None  # None: `rank` (one host)
    local_world_size: int | None = None  # None: `world_size`
    # shared with the launcher's monitor: each rank's latest iteration
    heartbeats: Sequence[float] | None = None
