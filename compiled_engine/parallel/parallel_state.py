"""Tensor-parallel group state. Without `init_tensor_parallel` the world is one rank and every
collective is a no-op, so single-process code never touches torch.distributed."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases (the GPU image's
# 2.11) lack it
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_group: dist.ProcessGroup | None = None
_rank = 0
_size = 1


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the whole default process group, which must be initialized) for TP."""
    global _group, _rank, _size
    _group = group if group is not None else dist.group.WORLD
    _rank = dist.get_rank(_group)
    _size = dist.get_world_size(_group)


def destroy_tensor_parallel() -> None:
    global _group, _rank, _size
    _group, _rank, _size = None, 0, 1


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


def get_tp_group() -> dist.ProcessGroup | None:
    return _group


def all_reduce(x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
    """Sum of `x` over the TP ranks. Functional collectives, so that torch.compile traces them.

    `ordered` (deterministic mode): every element summed in rank order, ((x0 + x1) + x2) + ...,
    whatever the tensor's size. A backend's all-reduce splits the tensor into chunks by its size and
    sums each chunk in its own order, so an element's sum would depend on the batch; with two ranks
    any order gives the same sum, so only larger groups gather and add."""
    if _size == 1:
        return x
    if not ordered or _size == 2:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", _group))
    parts = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, _group)).chunk(
        _size, dim=0
    )
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order. Eager only: the runner gathers the
    logits outside the compiled graphs (see `CompiledForward.__call__`)."""
    if _size == 1:
        return x
    gathered = x.new_empty((_size * x.shape[0], *x.shape[1:]))
    _all_gather_single(gathered, x.contiguous(), group=_group)
    return torch.cat(gathered.chunk(_size, dim=0), dim=dim)
