"""The paged KV cache's memory: one K and one V tensor per layer, `[num_slots, kv_heads, head_dim]`,
all zeros at start.

On the CPU each tensor is an anonymous memory mapping, which the OS zero-fills page by page on
first touch: the whole pool's address space is reserved at start, and resident memory follows the
slots requests write (`torch.zeros` would touch, and keep resident, every page of a pool sized at a
quarter of the machine's memory). Elsewhere, `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory becomes resident only where it is written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private, as malloc's large blocks are (Python's default, shared, is shmem); page-aligned (the
    # kernels want 64 bytes); kept alive by the tensor.
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


def kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K and the V tensor of every layer."""
    return ([zeroed(shape, dtype, device) for _ in range(num_layers)],
            [zeroed(shape, dtype, device) for _ in range(num_layers)])


def kv_pool_bytes(runner) -> int:
    """Bytes of a runner's K and V caches (every layer's)."""
    return sum(t.numel() * t.element_size() for t in (*runner.k_caches, *runner.v_caches))
