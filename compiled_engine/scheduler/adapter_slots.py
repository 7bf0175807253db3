"""The device's LoRA adapter slots (`SchedulerConfig.max_loras`): which adapter each holds, how many
running requests use it, and when it may be loaded with another.

A running request with an adapter holds that adapter's slot, so a step never uses more adapters than
there are slots. A slot nobody uses keeps its adapter (a later request of it loads nothing) until
another adapter needs a slot: the least recently used idle one is loaded again, once every step
that read it has committed (under overlap a step in flight may still be reading it). Adapter ids are
the engine's (0: the base model, no slot)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AdapterSlot:
    adapter: int = 0  # 0: empty
    users: int = 0  # running requests that use it
    barrier: int = -1  # the last step planned with a user of it
    last_used: int = 0  # when a request last took it (least recently used goes first)


class AdapterSlots:
    """`n` slots, the adapter each holds and its users; the loads the next plan carries."""

    def __init__(self, n: int) -> None:
        self.slots = [AdapterSlot() for _ in range(n)]
        self.by_adapter: dict[int, int] = {}  # adapter id -> its slot
        self.loads: list[tuple[int, int]] = []  # (slot, adapter) to load before the next step
        self.num_loads = 0
        self._clock = 0

    def acquire(self, adapter: int, committed: int) -> int | None:
        """A slot holding `adapter` for one more running request: its own, else the least recently
        used idle slot that no step in flight reads (loaded with it before the next step); None when
        every slot is in use."""
        index = self.by_adapter.get(adapter)
        if index is None:
            index = self._victim(committed)
            if index is None:
                return None
            slot = self.slots[index]
            if slot.adapter:
                del self.by_adapter[slot.adapter]
            slot.adapter = adapter
            self.by_adapter[adapter] = index
            self.loads.append((index, adapter))
            self.num_loads += 1
        slot = self.slots[index]
        slot.users += 1
        self._clock += 1
        slot.last_used = self._clock
        return index

    def release(self, index: int, last_step: int) -> None:
        """A user of slot `index`, last planned in step `last_step`, stopped running."""
        slot = self.slots[index]
        assert slot.users > 0, f"adapter slot {index} released more often than taken"
        slot.users -= 1
        slot.barrier = max(slot.barrier, last_step)

    def forget(self, adapter: int) -> bool:
        """Empty the slot of `adapter` (the engine unloads it); False while a request uses it."""
        index = self.by_adapter.get(adapter)
        if index is None:
            return True
        slot = self.slots[index]
        if slot.users:
            return False
        del self.by_adapter[adapter]
        slot.adapter = 0
        return True

    def take_loads(self) -> tuple[tuple[int, int], ...]:
        """The (slot, adapter) loads made since the last plan, for the next one."""
        loads = tuple(self.loads)
        self.loads.clear()
        return loads

    def _victim(self, committed: int) -> int | None:
        """The slot to load next: an empty one first, else the least recently used idle one whose
        last reader has committed."""
        best = None
        for i, slot in enumerate(self.slots):
            if slot.users or slot.barrier > committed:
                continue
            if not slot.adapter:
                return i
            if best is None or slot.last_used < self.slots[best].last_used:
                best = i
        return best

    def check(self, users: dict[int, int]) -> None:
        """Assert the books: `users` counts the running requests of each slot."""
        for i, slot in enumerate(self.slots):
            assert slot.users == users.get(i, 0), (
                f"adapter slot {i}: {slot.users} users on the books, {users.get(i, 0)} running"
            )
            if slot.adapter:
                assert self.by_adapter.get(slot.adapter) == i, f"adapter slot {i} not indexed"
            else:
                assert not slot.users, f"adapter slot {i} is empty but used"
        assert len(self.by_adapter) == sum(1 for s in self.slots if s.adapter), (
            "an adapter is indexed in no slot"
        )
