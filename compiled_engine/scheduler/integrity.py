"""The ledger's invariants (docs/architecture.md, "The ledger"), checked in full: O(pages +
requests), for tests, property machines and the server's `--debug` endpoint, never on a serving
path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.kv_book import KvBook
from compiled_engine.scheduler.plan import StepPlan
from compiled_engine.scheduler.request import Request, Status


def check_integrity(book: KvBook, cfg: SchedulerConfig, live: Mapping[str, Request],
                    running: Sequence[Request], waiting: Sequence[Request],
                    inflight: Sequence[StepPlan]) -> None:
    """Assert every invariant of the ledger: its book, the live requests by id, the running and
    waiting queues, the steps in flight; AssertionError names the breach."""
    ps = book.page_size
    # drafts asked for and not yet proposed: their pages are taken
    asked = {id(p.members[a.index]): a.k for p in inflight for a in p.draft_asks}
    book.allocator.check()
    book.rows.check()
    where: dict[int, str] = {}

    def claim(pages: list[int] | tuple[int, ...], place: str) -> None:
        for p in pages:
            assert 1 <= p < cfg.num_pages, f"page {p} ({place}) is outside the pool"
            assert p not in where, f"page {p} is both in {where[p]} and in {place}"
            where[p] = place

    claim(book.allocator.free_ids(), "the free list")
    claim(book.cache.cached_pages(), "the prefix cache")
    rows: dict[int, str] = {r: "the free rows" for r in book.rows.free_ids()}

    def claim_row(r: int, place: str) -> None:
        assert 0 <= r < cfg.max_rows, f"row {r} ({place}) is outside the table"
        assert r not in rows, f"row {r} is both in {rows[r]} and in {place}"
        rows[r] = place

    assert len(running) <= cfg.max_running, "more running requests than max_running"
    for req in running:
        name = f"request {req.rid!r}"
        assert req.status is Status.RUNNING and live.get(req.rid) is req, (
            f"{name}: not live running"
        )
        assert req.lock is not None, f"{name} runs without a prefix-cache lock"
        assert req.row >= 0, f"{name} runs without a table row"
        claim_row(req.row, name)
        assert 0 <= req.planned_len <= req.device_len <= req.max_len, (
            f"{name}: lengths cached {req.planned_len} device {req.device_len} max {req.max_len}"
        )
        assert req.planned_len < req.device_len or req.device_len == req.max_len, (
            f"{name}: nothing left to compute but not at its maximum length"
        )
        need = -(-req.planned_len // ps)
        assert need <= len(req.pages) <= -(-(req.planned_len + asked.get(id(req), 0)) // ps), (
            f"{name}: {len(req.pages)} pages for {req.planned_len} computed positions"
        )
        shared = tuple(req.pages[: req.prefix_pages])
        assert shared == book.cache.pages_of(req.lock), (
            f"{name}: row prefix differs from its cached path"
        )
        for p in shared:
            assert where.get(p) == "the prefix cache", (
                f"{name}: row points at page {p} not in the cache"
            )
        claim(req.pages[req.prefix_pages :], name)
    users: dict[int, int] = {}
    for req in running:
        if req.params.adapter:
            slot = req.adapter_slot
            assert slot >= 0 and book.adapters.slots[slot].adapter == req.params.adapter, (
                f"request {req.rid!r} runs with adapter {req.params.adapter} outside its slot"
            )
            users[slot] = users.get(slot, 0) + 1
        else:
            assert req.adapter_slot < 0, f"request {req.rid!r} holds an adapter slot it needs not"
    book.adapters.check(users)
    for req in waiting:
        name = f"waiting request {req.rid!r}"
        assert req.status is Status.WAITING and live.get(req.rid) is req, (
            f"{name}: not live waiting"
        )
        assert not req.pages and req.lock is None and req.row < 0 and req.adapter_slot < 0, (
            f"{name} holds resources"
        )
    assert len(live) == len(running) + len(waiting), (
        "live map out of sync with queues"
    )
    for d in book.deferred:
        assert d.barrier > book.committed, f"deferred release past its step {d.barrier}"
        claim(d.pages, f"deferred free (step {d.barrier})")
        if d.row >= 0:
            claim_row(d.row, f"deferred row (step {d.barrier})")
    missing = [p for p in range(1, cfg.num_pages) if p not in where]
    assert not missing, f"pages {missing[:8]} are nowhere (leaked)"
    assert len(rows) == cfg.max_rows, "a table row is leaked"
    held = [r.lock for r in running] + [d.lock for d in book.deferred if d.lock is not None]
    book.cache.check(held)
    if not running and not inflight:
        assert not book.deferred, "deferred frees with no step in flight"
        cached = len(book.cache.cached_pages())
        assert book.allocator.num_free + cached == book.allocator.total, (
            f"idle: free {book.allocator.num_free} + cached {cached} != total "
            f"{book.allocator.total}"
        )
