"""The workload generators: deterministic, with the lengths and sharing they promise."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.datasets import (
    FIRST_ID,
    LengthRange,
    PrefixShape,
    all_requests,
    prefix_dataset,
    random_dataset,
    rounds,
)


def test_length_range_parsing() -> None:
    assert LengthRange.parse("64:512") == LengthRange(64, 512)
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("100", ratio=0.5) == LengthRange(50, 150)
    for bad in ("0:4", "9:3", "x"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_random_dataset_is_deterministic_and_uniform_in_its_ranges() -> None:
    make = lambda seed: random_dataset(800, LengthRange(64, 512), LengthRange(64, 256), 8000, seed)
    a, b, c = make(0), make(0), make(1)
    assert a == b and a != c
    reqs = all_requests(a)
    assert len(a) == 800 and all(len(s) == 1 for s in a)
    ins = [len(r.prompt_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert (
        64 <= min(ins) < 74
        and 502 < max(ins) <= 512
        and 64 <= min(outs) < 68
        and 252 < max(outs) <= 256
    )
    assert abs(statistics.mean(ins) - 288) < 20 and abs(statistics.mean(outs) - 160) < 8
    # uniform: each quarter of the input range holds about a quarter of the requests
    quarters = [sum(64 + 112 * q <= n < 64 + 112 * (q + 1) for n in ins) for q in range(4)]
    assert all(150 < q < 250 for q in quarters), quarters
    ids = [t for r in reqs for t in r.prompt_ids]
    assert min(ids) >= FIRST_ID and max(ids) < 8000


def test_prefix_dataset_shares_a_system_prompt_and_extends_each_chat() -> None:
    shape = PrefixShape(
        system_len=100,
        num_shared=5,
        question_len=7,
        num_chats=3,
        turns=4,
        user_len=11,
        answer_len=13,
        output_len=LengthRange(8, 8),
    )
    sessions = prefix_dataset(shape, 8000, seed=3)
    assert sessions == prefix_dataset(shape, 8000, seed=3)
    assert len(sessions) == 5 + 3 and len(all_requests(sessions)) == 5 + 3 * 4
    system = sessions[0][0].prompt_ids[:100]
    for s in sessions:
        assert s[0].prompt_ids[:100] == system
    for s in sessions[:5]:
        assert len(s) == 1 and len(s[0].prompt_ids) == 107
    for chat in sessions[5:]:
        assert [len(r.prompt_ids) for r in chat] == [111, 135, 159, 183]
        for prev, cur in zip(chat, chat[1:], strict=False):
            assert cur.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
    assert [len(b) for b in rounds(sessions)] == [8, 3, 3, 3]
