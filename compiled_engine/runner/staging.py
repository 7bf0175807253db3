"""Host -> device uploads of a step's integer inputs, without a host sync (after mini-sglang).

A step's lists (positions, slots, lengths, table writes) are packed into a pinned host buffer (one
block per dtype) and reach the device in one non-blocking copy per field, into a `DeviceSlab`. A
captured CUDA graph's static inputs are such a slab, so a decode step's inputs are copied straight
into the buffers the graph reads. Host buffers form a ring: a buffer is written again only once the
event recorded behind its last copy has passed, and when none has, the ring grows instead of waiting
(on the CPU copies are synchronous and the event is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class DeviceEvent(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class HostEvent:
    """The CPU's event: work on the CPU is done when it returns, so there is nothing to wait for."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def event_factory(device: torch.device) -> Callable[[], DeviceEvent]:
    return torch.cuda.Event if device.type == "cuda" else HostEvent


Fields = dict[str, tuple[Sequence[int], torch.dtype]]


@dataclass
class DeviceSlab:
    """A step's device tensors by name, each its own allocation: graph inputs that are views into
    one buffer would make dynamo guard on their storage offsets (and duck-size them against other
    sizes)."""

    fields: dict[str, torch.Tensor]

    @property
    def sizes(self) -> list[tuple[str, int]]:
        return [(name, t.numel()) for name, t in self.fields.items()]

    @classmethod
    def allocate(
        cls, layout: dict[str, tuple[int, torch.dtype]], device: torch.device
    ) -> DeviceSlab:
        return cls(
            {
                name: torch.empty(n, dtype=dtype, device=device)
                for name, (n, dtype) in layout.items()
            }
        )


class _HostBuffer:
    """One ring entry: a (pinned) host block per dtype, and the event behind its last copy."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.blocks: dict[torch.dtype, torch.Tensor] = {}
        self.event: DeviceEvent | None = None

    def block(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        have = self.blocks.get(dtype)
        if have is None or have.numel() < n:
            have = torch.empty(max(n, 2 * (0 if have is None else have.numel()), 1024), dtype=dtype,
                               pin_memory=self.pinned)
            self.blocks[dtype] = have
        return have[:n]


class Staging:
    """Uploads through a ring of host buffers (pinned on CUDA). `make_event`: the device's event
    type (tests pass a fake one to check the ring's waits)."""

    def __init__(self, device: torch.device, ring: int = 2,
                 make_event: Callable[[], DeviceEvent] | None = None) -> None:
        self.device = device
        self.make_event = make_event or event_factory(device)
        self._ring = [_HostBuffer(pinned=device.type == "cuda") for _ in range(ring)]
        self._next = 0

    @property
    def ring_size(self) -> int:
        return len(self._ring)

    def _free_buffer(self) -> _HostBuffer:
        """The next ring entry whose last copy has run (never waits: a new entry when all are in
        use)."""
        for i in range(len(self._ring)):
            j = (self._next + i) % len(self._ring)
            host = self._ring[j]
            if host.event is None or host.event.query():
                self._next = (j + 1) % len(self._ring)
                return host
        host = _HostBuffer(self._ring[0].pinned)
        self._ring.insert(self._next, host)
        self._next = (self._next + 1) % len(self._ring)
        return host

    def upload(self, fields: Fields, into: DeviceSlab | None = None) -> DeviceSlab:
        """Copy `fields` to the device: into `into` (same names and sizes, e.g. a graph's static
        inputs) or a new slab. Returns at once on CUDA; the copies are ordered before later work on
        the stream."""
        layout = {name: (len(values), dtype) for name, (values, dtype) in fields.items()}
        if into is None:
            into = DeviceSlab.allocate(layout, self.device)
        elif into.sizes != [(name, n) for name, (n, _) in layout.items()]:
            raise ValueError(f"step inputs {layout} do not fit the static buffers {into.sizes}")
        host = self._free_buffer()
        packed: dict[torch.dtype, list[int]] = {}
        for values, dtype in fields.values():
            packed.setdefault(dtype, []).extend(values)
        staged = {
            dtype: host.block(dtype, len(values)) for dtype, values in packed.items() if values
        }
        for dtype, block in staged.items():
            block.copy_(torch.tensor(packed[dtype], dtype=dtype))
        offsets = dict.fromkeys(staged, 0)
        for name, (values, dtype) in fields.items():
            if values:
                at = offsets[dtype]
                into.fields[name].copy_(
                    staged[dtype][at : at + len(values)], non_blocking=host.pinned
                )
                offsets[dtype] = at + len(values)
        host.event = self.make_event()
        host.event.record()
        return into


def to_device(
    values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list on the device without a host sync: through pinned memory on CUDA (torch's
    host allocator reuses the block only after its copy has run); on the CPU the host tensor
    itself."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(
        device, non_blocking=True
    )
