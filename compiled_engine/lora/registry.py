"""The adapters an engine serves, by name: each with its engine id (the ledger's
`LedgerParams.adapter`), its path, and its weights on the host, read and checked once when it is
added (at most `max_cpu_loras` of them: a slot's load never reads a file inside a step). Reading is
apart from serving (`read` may run on a thread while the engine steps; `serve` is cheap), and a
file larger than the model's largest adapter could be is refused before it is read."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.lora.folder import PEFT_FILES
from compiled_engine.lora.gguf import load_gguf_lora
from compiled_engine.lora.peft import load_peft
from compiled_engine.lora.slots import LoRASlots
from compiled_engine.lora.weights import AdapterError, AdapterTargets, AdapterWeights


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    id: int  # the engine's (> 0)
    path: str


# an adapter's config, and what a file may hold beyond its tensors' values (headers, metadata)
CONFIG_MAX_BYTES = 1 << 20
FILE_SLACK_BYTES = 16 << 20


def read_adapter(path: str, slots: LoRASlots) -> AdapterWeights:
    """An adapter's weights from its folder (PEFT) or GGUF file."""
    try:
        p = Path(path)
        limit = slots.max_adapter_bytes() + FILE_SLACK_BYTES
        if p.is_file() and p.suffix == ".gguf":
            _check_size(p, limit)
            return load_gguf_lora(p, adapter_targets(slots))
        if not p.exists():
            raise AdapterError(f"no adapter at {cut(path)!r}")
        config, tensors = (p / name for name in PEFT_FILES)
        _check_size(config, CONFIG_MAX_BYTES)
        _check_size(tensors, limit)
        return load_peft(p)
    except OSError as e:  # a name too long, a folder it may not enter, ...
        raise AdapterError(f"cannot read the adapter at {cut(path)!r}: {e.strerror or e}") from None


def adapter_targets(slots: LoRASlots) -> AdapterTargets:
    """What `slots`' model lets an adapter hold: each projection's features, the rank limit."""
    projections = {path: t.full_shape() for path, t in slots.targets.items()}
    return AdapterTargets(projections, slots.max_rank, slots.heads(), slots.num_layers)


def _check_size(file: Path, limit: int) -> None:
    """AdapterError for a file larger than `limit` bytes (an absent one is the reader's to name)."""
    size = file.stat().st_size if file.is_file() else 0
    if size > limit:
        raise AdapterError(f"{cut(str(file))!r} has {size} bytes, more than an adapter of this "
                           f"model can (at most {limit})")


def cut(text: str, limit: int = 200) -> str:
    """`text` for an error message, cut to `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


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
        return self.serve(name, path, self.read(name, path))

    def read(self, name: str, path: str) -> AdapterWeights:
        """The adapter at `path`, read and checked against the model (changes nothing here: safe
        on a thread while the engine steps); AdapterError when it cannot be served as `name`."""
        self._check_room(name)
        weights = read_adapter(path, self.slots)
        self.slots.check(weights, cut(name))
        return weights

    def serve(self, name: str, path: str, weights: AdapterWeights) -> Adapter:
        """Serve `weights` (from `read`) as `name`; AdapterError if the name was taken or the
        adapters reached `max_cpu_loras` since."""
        self._check_room(name)
        adapter = Adapter(name, next(self._ids), str(path))
        self.by_name[name] = adapter
        self._host[adapter.id] = weights
        return adapter

    def _check_room(self, name: str) -> None:
        if name in self.by_name:
            raise AdapterError(f"an adapter named {cut(name)!r} is already loaded")
        if len(self.by_name) >= self.max_cpu_loras:
            raise AdapterError(f"{len(self.by_name)} adapters are loaded, the most this server "
                               f"keeps (--max-cpu-loras {self.max_cpu_loras}): unload one first")

    def remove(self, name: str) -> Adapter:
        adapter = self.by_name.pop(name)
        del self._host[adapter.id]
        return adapter

    def load_slots(self, loads: tuple[tuple[int, int], ...]) -> None:
        """Put each (slot, adapter id) the ledger planned into the device's slots (an adapter
        unloaded since: the slot is emptied)."""
        for slot, adapter_id in loads:
            self.slots.load(slot, self._host.get(adapter_id))
