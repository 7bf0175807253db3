"""Joining the TP world: NCCL for the model's collectives on CUDA (gloo on the CPU), plus a gloo
group that carries rank 0's inputs and the debug digests (control traffic stays on the host)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from compiled_engine.parallel.parallel_state import init_tensor_parallel


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    local_world_size: int,
) -> dist.ProcessGroup:
    """Initialize the default group (the TP group) and return the gloo control group."""
    # ranks on a host share its cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if init_method.startswith("file://") and sys.platform == "linux":
        # one host: gloo's (and NCCL's bootstrap) sockets on loopback, not the host's address
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    init_tensor_parallel()
    # Inputs get their own group: with overlap the forward's collectives run in a worker thread, and
    # two threads interleaving ops on one group would pair them differently on different ranks.
    return dist.new_group(backend="gloo", timeout=timeout)


def destroy_distributed() -> None:
    from compiled_engine.parallel.parallel_state import destroy_tensor_parallel

    destroy_tensor_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
