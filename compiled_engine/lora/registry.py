"""The adapters an engine serves, by name: each with its engine id (the ledger's
`LedgerParams.adapter`), its path, and its weights on the host, read and checked once when it is
added (at most `max_cpu_loras` of them: a slot's load never reads a file inside a step)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.lora.gguf import load_gguf_lora
from compiled_engine.lora.peft import load_peft
from compiled_engine.lora.slots import LoRASlots
from compiled_engine.lora.weights import AdapterError, AdapterWeights


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    id: int  # the engine's (> 0)
    path: str


def read_adapter(path: str, slots: LoRASlots) -> AdapterWeights:
    """An adapter's weights from its folder (PEFT) or GGUF file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf_lora(p, slots.heads())
    if not p.exists():
        raise AdapterError(f"no adapter at {path!r}")
    return load_peft(p)


class LoRARegistry:
    """The adapters served by name (at most `max_cpu_loras`) and the device slots they load into."""

    def __init__(self, slots: LoRASlots, max_cpu_loras: int) -> None:
        self.slots = slots
        self.max_cpu_loras = max_cpu_loras
        self.by_name: dict[str, Adapter] = {}
        self._host: dict[int, AdapterWeights] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> Adapter:
        """Read and check an adapter, then serve it as `name`; AdapterError (nothing changed) when
        it cannot be served or the name is taken."""
        if name in self.by_name:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        if len(self.by_name) >= self.max_cpu_loras:
            raise AdapterError(f"{len(self.by_name)} adapters are loaded, the most this server "
                               f"keeps (--max-cpu-loras {self.max_cpu_loras}): unload one first")
        weights = read_adapter(path, self.slots)
        self.slots.check(weights, name)
        adapter = Adapter(name, next(self._ids), str(path))
        self.by_name[name] = adapter
        self._host[adapter.id] = weights
        return adapter

    def remove(self, name: str) -> Adapter:
        adapter = self.by_name.pop(name)
        del self._host[adapter.id]
        return adapter

    def load_slots(self, loads: tuple[tuple[int, int], ...]) -> None:
        """Put each (slot, adapter id) the ledger planned into the device's slots (an adapter
        unloaded since: the slot is emptied)."""
        for slot, adapter_id in loads:
            self.slots.load(slot, self._host.get(adapter_id))
