"""A deterministic pseudo-model that executes plans without torch, through simulated tables
(test-only).

The next token is a hash chain over the sequence; the chain value of every position is read back
through the simulated page table and KV pool, so a wrong slot, a missing table write or a stale page
changes the output (and, with ``verify``, fails an assertion naming the problem: each slot must hold
this row's position, token and chain value, so a stale page with the same token at the same position
is caught).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.plan import StepOutput, StepPlan, TierLoad, TokenEvent
from compiled_engine.scheduler.request import Request
from compiled_engine.scheduler.scheduler import Scheduler

# (request, at most this many) -> draft tokens that continue the request's known tokens
Proposer = Callable[[Request, int], tuple[int, ...]]

_MOD = (1 << 61) - 1


def mix(h: int, token: int, position: int, adapter: int = 0) -> int:
    """The chain value after `token` at `position`; a LoRA adapter's requests chain otherwise."""
    return (h * 1_000_003 + token * 7919 + position + 1 + adapter * 104_729) % _MOD


def reference_output(
    prompt: tuple[int, ...] | list[int],
    max_len: int,
    stop_ids: frozenset[int] | set[int],
    min_tokens: int,
    vocab_size: int,
    adapter: int = 0,
) -> list[int]:
    """Greedy output of the fake model for one request run alone (same finish rules)."""
    h = 0
    for p, t in enumerate(prompt):
        h = mix(h, t, p, adapter)
    out: list[int] = []
    n = len(prompt)
    while n + len(out) < max_len:
        tok = h % vocab_size
        out.append(tok)
        if tok in stop_ids and len(out) > min_tokens:
            break
        h = mix(h, tok, n + len(out) - 1, adapter)
    return out


class FakeExecutor:
    """Runs a ``StepPlan`` like the runner would: table writes, gather, KV store, sample
    (greedy)."""

    def __init__(self, config: SchedulerConfig, vocab_size: int = 64, verify: bool = True) -> None:
        self.vocab_size = vocab_size
        self.page_size = config.page_size
        self.verify = verify
        width = config.max_context
        self.token_table = [[-1] * width for _ in range(config.max_rows)]
        self.page_table = [[-1] * width for _ in range(config.max_rows)]
        self.kv: list[tuple[int, int, int] | None] = [None] * (config.num_pages * config.page_size)
        self.dummy_slots = range(config.page_size)  # page 0: padding rows only ever read it
        self.steps = 0  # plans executed
        self.adapter_in_slot: dict[int, int] = {}  # LoRA: the adapter each device slot holds
        # step, slot/row -> rid, the adapter slots it reads
        self._pending: deque[tuple[int, dict[int, str], dict[int, str], set[int]]] = deque()

    def execute(self, batch: StepPlan) -> StepOutput:
        self.steps += 1
        slots_used: dict[int, str] = {}
        rows_used: dict[int, str] = {}
        for slot, adapter in batch.adapter_loads:
            for step, _, _, lora_slots in self._pending:
                assert slot not in lora_slots, (
                    f"adapter slot {slot} loaded while step {step}, which reads it, is in flight"
                )
            self.adapter_in_slot[slot] = adapter
        lora_used = {rs.lora_slot for rs in batch.reqs if rs.lora_slot >= 0}
        for tw in batch.token_writes:
            self.token_table[tw.row][tw.start : tw.start + len(tw.tokens)] = tw.tokens
        for sw in batch.slot_writes:
            self.page_table[sw.row][sw.start : sw.start + len(sw.slots)] = sw.slots
        for load in batch.tier_loads:
            self._load(batch, load)
        sampled = []
        assert len({rs.row for rs in batch.reqs}) == len(batch.reqs), (
            f"step {batch.step}: a row twice"
        )
        for rs in batch.reqs:
            row = rs.row
            assert rs.length >= 1 and len(rs.out_slots) == rs.length, (
                f"{rs.rid}: bad step length {rs.length}"
            )
            tokens, table = self.token_table[row], self.page_table[row]
            adapter = self.adapter_in_slot[rs.lora_slot] if rs.lora_slot >= 0 else 0
            h = self._read(table, tokens, rs.start - 1, rs.rid)[2] if rs.start else 0
            if self.verify:
                self._check_not_in_flight(rs.rid, rs.out_slots, row)
                chain = 0
                for q in range(rs.start):  # every slot holds this row's chain value: no stale page
                    entry = self._read(table, tokens, q, rs.rid)
                    chain = mix(chain, tokens[q], q, adapter)
                    assert entry[2] == chain, (
                        f"{rs.rid}: position {q} reads slot {table[q]}: the right token, another "
                        "sequence's KV"
                    )
                slots_used.update((s, rs.rid) for s in table[: rs.start + rs.length])
                rows_used[row] = rs.rid
            chain = []  # the hash after each computed position
            for i in range(rs.length):
                p = rs.start + i
                slot = rs.out_slots[i]
                assert table[p] == slot, (
                    f"{rs.rid}: page table[{row}, {p}] = {table[p]}, plan writes {slot}"
                )
                assert slot not in self.dummy_slots, (
                    f"{rs.rid}: writes KV into the dummy page (slot {slot})"
                )
                tok = tokens[p]
                assert tok >= 0, f"{rs.rid}: no token on the device at row {row} position {p}"
                h = mix(h, tok, p, adapter)
                self.kv[slot] = (p, tok, h)
                chain.append(h)
            if rs.sample:  # at the last position, or at each verified one (the drafts')
                for i in range(rs.length - rs.num_sampled, rs.length):
                    tok = chain[i] % self.vocab_size
                    tokens[rs.start + i + 1] = tok
                    sampled.append(tok)
        self._pending.append((batch.step, slots_used, rows_used, lora_used))
        return StepOutput(sampled)

    def retire(self, step: int) -> None:
        """The scheduler committed ``step``."""
        assert self._pending and self._pending[0][0] == step, f"retire of step {step} out of order"
        self._pending.popleft()

    def _read(self, table: list[int], tokens: list[int], q: int, rid: str) -> tuple[int, int, int]:
        entry = self.kv[table[q]] if table[q] >= 0 else None
        assert entry is not None, f"{rid}: position {q} reads slot {table[q]} that holds no KV"
        if self.verify:
            assert entry[0] == q and entry[1] == tokens[q], (
                f"{rid}: position {q} (token {tokens[q]}) reads slot {table[q]} holding position "
                f"{entry[0]} token {entry[1]} (stale or wrong page)"
            )
        return entry

    def _load(self, batch: StepPlan, load: TierLoad) -> None:
        """Write the KV a prefill would have into the pages of a tier load (the engine's host copy
        of the request's prompt pages)."""
        rs = next(r for r in batch.reqs if r.rid == load.rid)
        tokens, ps = self.token_table[rs.row], self.page_size
        adapter = self.adapter_in_slot[rs.lora_slot] if rs.lora_slot >= 0 else 0
        slots = [p * ps + o for p in load.pages for o in range(ps)]
        if self.verify:
            self._check_not_in_flight(rs.rid, tuple(slots), rs.row)
        h = 0
        for q in range((load.first + len(load.pages)) * ps):
            assert tokens[q] >= 0, f"{rs.rid}: a tier load before its prompt is on the device"
            h = mix(h, tokens[q], q, adapter)
            if q >= load.first * ps:
                self.kv[slots[q - load.first * ps]] = (q, tokens[q], h)

    def _check_not_in_flight(self, rid: str, out_slots: tuple[int, ...], row: int) -> None:
        for step, slots, rows, _ in self._pending:
            owner = rows.get(row)
            assert owner in (None, rid), (
                f"{rid}: row {row} reused while step {step} of {owner} is in flight"
            )
            for s in out_slots:
                owner = slots.get(s)
                assert owner in (None, rid), (
                    f"{rid}: slot {s} reused while step {step} of {owner} is in flight"
                )


def plan_step(scheduler: Scheduler, propose: Proposer | None = None) -> StepPlan | None:
    """`schedule()`, then the drafts it asks for from `propose` (none without one), as the engine
    does."""
    plan = scheduler.schedule()
    if plan is None or not plan.draft_asks:
        return plan
    drafts = [propose(plan.members[a.index], a.k) if propose is not None else ()
              for a in plan.draft_asks]
    return scheduler.add_drafts(plan, drafts)


def run_to_completion(
    scheduler: Scheduler, executor: FakeExecutor, lag: int = 0,
    propose: Proposer | None = None,
) -> list[TokenEvent]:
    """Drive until idle; ``lag=1`` plans step k+1 before committing step k (overlap)."""
    events: list[TokenEvent] = []
    pending: deque[tuple[StepPlan, StepOutput]] = deque()
    while scheduler.has_work():
        batch = plan_step(scheduler, propose) if len(pending) <= lag else None
        if batch is not None:
            pending.append((batch, executor.execute(batch)))
        if pending and (batch is None or len(pending) > lag):
            done, output = pending.popleft()
            events.extend(scheduler.commit(done, output))
            executor.retire(done.step)
        elif batch is None:
            raise AssertionError(
                "scheduler stalled: work left but nothing planned and nothing in flight"
            )
    return events
