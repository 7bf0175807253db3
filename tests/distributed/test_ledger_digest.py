"""The TP debug digest: what it covers, and the error that names the step where ranks diverged."""

from __future__ import annotations

import pytest

from compiled_engine.ranks.digest import LedgerDivergence, check_digests, ledger_digest
from compiled_engine.ranks.monitor import describe_exit
from compiled_engine.scheduler.plan import Batch, ReqStep, TokenEvent


def _batch(order: tuple[str, ...]) -> Batch:
    reqs = tuple(ReqStep(rid, i, 0, 1, (10 + i,), True) for i, rid in enumerate(order))
    return Batch(step=3, reqs=reqs, slot_writes=(), token_writes=(), is_decode=True)


def test_digest_sees_batch_order_and_tokens() -> None:
    events = [TokenEvent("a", 5, False, None)]
    base = ledger_digest(3, _batch(("a", "b")), events)
    assert base == ledger_digest(3, _batch(("a", "b")), list(events))
    assert base != ledger_digest(3, _batch(("b", "a")), events)  # a set-ordered batch on one rank
    assert base != ledger_digest(3, _batch(("a", "b")), [TokenEvent("a", 6, False, None)])


def test_divergence_names_the_step() -> None:
    check_digests(7, [42, 42])
    with pytest.raises(LedgerDivergence, match="diverged at engine step 7"):
        check_digests(7, [42, 43])


def test_exit_codes_read_clearly() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"
