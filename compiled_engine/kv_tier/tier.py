"""Pages between the KV pool and the store: written through as the radix cache takes them (copied
out at once, written on a thread), read back for a waiting request's prompt, and loaded into the
fresh pages the ledger gives it (`StepPlan.tier_loads`), before the step that reads them."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from compiled_engine.kv_tier.keys import page_keys
from compiled_engine.kv_tier.store import PageStore
from compiled_engine.scheduler.prefix_cache import CacheRemoved, CacheStored

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 1 << 30  # pages waiting for the disk; past it new ones are not stored


@dataclass(frozen=True, slots=True)
class HostPages:
    """A prompt's pages [first, first + len(kv)) read from the tier: kv [n, layers, 2 (K, V),
    page_size, kv_heads, head_dim] on the host."""

    first: int
    kv: torch.Tensor

    @property
    def end(self) -> int:
        return self.first + self.kv.shape[0]


class KVTier:
    def __init__(self, store: PageStore, seed: bytes, page_size: int,
                 k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 adapter_seeds: Callable[[], dict[int, bytes]]) -> None:
        """`adapter_seeds`: the adapters served now, id -> the hash of their files."""
        self.store, self.seed, self.page_size = store, seed, page_size
        self.k_caches, self.v_caches = list(k_caches), list(v_caches)
        self.adapter_seeds = adapter_seeds
        self.dtype = self.k_caches[0].dtype
        self.page_shape = (len(self.k_caches), 2, page_size, *self.k_caches[0].shape[1:])
        self.page_bytes = self.dtype.itemsize * torch.Size(self.page_shape).numel()
        self.num_written = 0  # pages written to the store
        self.num_dropped = 0  # pages not stored: the disk was behind
        self.num_read = 0  # pages read back
        self._writes: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._queued_bytes = 0  # in `_writes` (the writer takes them off)
        self._queued_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._writer.start()

    # ---- the prompt of a waiting request ------------------------------------------------------

    def keys(self, tokens: Sequence[int], adapter_seeds: dict[int, bytes]) -> list[bytes]:
        """The keys of a prompt's pages that may come from the tier (prefix-cache tokens; not its
        last position, which is always computed)."""
        limit = (len(tokens) - 1) // self.page_size
        return page_keys(tokens[: limit * self.page_size], self.page_size, self.seed,
                         adapter_seeds)

    def stored_after(self, keys: Sequence[bytes], first: int) -> int:
        """The end of the run of pages the store has from page `first` on."""
        end = first
        while end < len(keys) and keys[end] in self.store:
            end += 1
        return end

    def touch(self, keys: Sequence[bytes]) -> None:
        """Note a use of the stored pages among `keys` (a prompt the pool serves: its pages stay
        the store's most recent)."""
        self.store.touch(keys)

    def fetch(self, first: int, keys: Sequence[bytes]) -> HostPages | None:
        """Read pages `keys` (from page `first` on) up to the first that is missing or does not
        check out; None when the first one does not."""
        pages = []
        for key in keys:
            payload = self.store.get(key)
            if payload is None or len(payload) != self.page_bytes:
                break
            pages.append(torch.frombuffer(bytearray(payload), dtype=self.dtype)
                         .view(self.page_shape))
        if not pages:
            return None
        self.num_read += len(pages)
        return HostPages(first, torch.stack(pages))

    def load(self, pages: Sequence[int], kv: torch.Tensor) -> None:
        """Write host pages `kv` into pool pages `pages` (no step in flight touches them)."""
        device = self.k_caches[0].device
        slots = self._slots(pages, device)
        kv = kv.to(device, non_blocking=True)
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
            k.index_copy_(0, slots, kv[:, layer, 0].flatten(0, 1))
            v.index_copy_(0, slots, kv[:, layer, 1].flatten(0, 1))

    # ---- writing through ----------------------------------------------------------------------

    def save(self, events: Sequence[CacheStored | CacheRemoved]
             ) -> list[tuple[CacheStored, list[bytes]]]:
        """Copy out the pages the radix cache stored that the store lacks, for the writer; returns
        each event that had such pages with the keys of its pages (`CacheStored.path[start:]`)."""
        seeds = self.adapter_seeds()
        queued = []
        for ev in events:
            if not isinstance(ev, CacheStored) or not ev.pages:
                continue
            keys = page_keys(ev.path, self.page_size, self.seed, seeds)
            first = ev.start // self.page_size
            new = [(key, page) for key, page in zip(keys[first:], ev.pages, strict=True)
                   if key not in self.store]
            if not new:
                continue
            size = len(new) * self.page_bytes
            with self._queued_lock:
                if self._queued_bytes + size > MAX_QUEUED_BYTES:
                    self.num_dropped += len(new)
                    continue
                self._queued_bytes += size
            self._writes.put(([key for key, _ in new], self._gather([p for _, p in new])))
            queued.append((ev, keys[first:]))
        return queued

    def flush(self) -> None:
        """Wait until every page handed to the writer is stored."""
        self._writes.join()

    def shutdown(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join()
        self.store.close()

    def _gather(self, pages: Sequence[int]) -> torch.Tensor:
        """Pool pages `pages` as one host tensor [n, layers, 2, page_size, kv_heads, head_dim]."""
        slots = self._slots(pages, self.k_caches[0].device)
        kv = torch.stack([torch.stack((k[slots], v[slots]))
                          for k, v in zip(self.k_caches, self.v_caches, strict=True)])
        n = len(pages)
        kv = kv.view(len(self.k_caches), 2, n, *self.page_shape[2:]).permute(2, 0, 1, 3, 4, 5)
        return kv.contiguous().cpu()

    def _slots(self, pages: Sequence[int], device: torch.device) -> torch.Tensor:
        ps = self.page_size
        base = torch.tensor(pages, dtype=torch.long).mul_(ps)
        return (base[:, None] + torch.arange(ps)).flatten().to(device)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                keys, kv = item
                try:
                    for key, page in zip(keys, kv, strict=True):
                        if self.store.put(key, page.view(torch.uint8).numpy().tobytes()):
                            self.num_written += 1
                except OSError as e:  # a full or failing disk: those pages are not stored
                    log.warning("KV tier: a page write failed (%s)", e)
                with self._queued_lock:
                    self._queued_bytes -= len(keys) * self.page_bytes
            finally:
                self._writes.task_done()
