"""Deterministic mode's all-reduce at 4 ranks (gloo): every element is the rank-order sum, bit for
bit, whatever the size of the tensor it travels in."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compiled_engine.parallel import parallel_state as ps
from compiled_engine.ranks.launcher import free_port

WORLD = 4


def _rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    ps.init_tensor_parallel()
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        rows = torch.randn(37, 24, generator=gen).to(torch.bfloat16) * (10.0 ** rank)
        whole = ps.all_reduce(rows, ordered=True)
        alone = torch.cat([ps.all_reduce(rows[i : i + 1], ordered=True) for i in range(len(rows))])
        out[rank] = (rows, whole, alone)
    finally:
        ps.destroy_tensor_parallel()
        dist.destroy_process_group()


def test_ordered_all_reduce_is_the_rank_order_sum_at_any_size() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            _rank, args=(free_port(), out), nprocs=WORLD, start_method="spawn", join=True
        )
        results = dict(out)
    parts = [results[r][0] for r in range(WORLD)]
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for rank in range(WORLD):
        _, whole, alone = results[rank]
        assert torch.equal(whole, expected) and torch.equal(alone, expected), rank
