"""Requests whose prompt's pages the KV tier has wait here while every rank reads them, outside the
engine's steps.

Rank 0 finds the pages (`Engine.tier_span`) before it forwards the request and names them in
`Add.tier_span`; every rank then reads its own copy of those pages on a thread (its tier holds its
shard) and keeps the request out of its engine. When rank 0's read has finished, rank 0 sends
`TierRead` with the next inputs; every rank waits for its own read there, and the ranks agree on how
many pages all of them read (a page missing or corrupt on one rank is recomputed by all), so that
every ledger adds the request with the same pages, at the same step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from compiled_engine.kv_tier.tier import HostPages
from compiled_engine.ranks.messages import Add

# the most pages' bytes read for waiting requests at once: past it a request is prefilled instead
MAX_HELD_BYTES = 2 << 30


class TierWait:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._waiting: dict[str, tuple[Add, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None  # one thread: reads queue behind each other

    def __len__(self) -> int:
        return len(self._waiting)

    def room(self, span: tuple[int, int]) -> bool:
        """Rank 0: whether a request's pages `span` may be read now (`MAX_HELD_BYTES`)."""
        held = sum(m.tier_span[1] - m.tier_span[0] for m, _ in self._waiting.values())
        return (held + span[1] - span[0]) * self._engine.tier.page_bytes <= MAX_HELD_BYTES

    def hold(self, msg: Add) -> bool:
        """Keep `msg` here while its pages are read, if rank 0 found some; False: add it now."""
        if msg.tier_span is None or self._engine.tier is None:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-read")
        read = self._engine.tier_reader(msg.prompt_ids, msg.lora_name, msg.tier_span,
                                         msg.params.cache_salt)
        self._waiting[msg.rid] = (msg, self._pool.submit(read))
        return True

    def ready(self) -> tuple[str, ...]:
        """The requests whose read has finished here, in arrival order (rank 0 sends them on)."""
        return tuple(rid for rid, (_, future) in self._waiting.items() if future.done())

    def admit(self, rids: tuple[str, ...], control) -> list[tuple[Add, HostPages | None]]:
        """Take `rids` out (an aborted one is gone), each with the pages every rank has read."""
        out = []
        for rid in rids:
            if rid not in self._waiting:
                continue
            msg, future = self._waiting.pop(rid)
            try:
                host = future.result()
            except OSError:
                host = None
            n = _agreed_pages(0 if host is None else host.kv.shape[0], control)
            out.append((msg, None if n == 0 else HostPages(host.first, host.kv[:n])))
        return out

    def drop(self, rid: str) -> bool:
        """Forget an aborted or finished request; False if it was not here."""
        return self._waiting.pop(rid, None) is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _agreed_pages(n: int, control) -> int:
    """The fewest pages any rank read (ours with a single rank)."""
    if control is None:
        return n
    import torch.distributed as dist

    counts: list[int | None] = [None] * dist.get_world_size(control)
    dist.all_gather_object(counts, n, group=control)
    return min(int(c) for c in counts)
