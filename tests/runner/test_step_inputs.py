"""The logits-row contract of `build_step_inputs`: logits row j belongs to the j-th sampling request
of the plan, whatever the step's shape and wherever the non-sampling requests (prefill chunks)
sit."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.runner.staging import Staging
from compiled_engine.runner.step_inputs import DeviceTables, build_step_inputs
from compiled_engine.scheduler.plan import ReqStep, StepPlan, TokenWrite

STAGING = Staging(torch.device("cpu"))


def _tables() -> DeviceTables:
    tables = DeviceTables(max_rows=4, max_context=16, device=torch.device("cpu"))
    # token (row, position) = 100 * row + position: a gathered token says which row and position it
    # came from
    writes = tuple(TokenWrite(row, 0, tuple(100 * row + p for p in range(16))) for row in range(4))
    tables.apply_writes(StepPlan(0, (), (), writes, False), STAGING)
    return tables


def _sampled_tokens(batch: StepPlan, pad_to: int | None) -> list[int]:
    """The input token at each logits row the runner keeps (a model whose logits are its input)."""
    inputs = build_step_inputs(batch, _tables(), pad_to=pad_to, staging=STAGING)
    assert inputs.logits_index.shape[0] >= inputs.num_sampled
    return inputs.input_ids[inputs.logits_index[: inputs.num_sampled]].tolist()


@pytest.mark.parametrize("pad_to", [None, 4, 8])
def test_decode_shaped_step_with_a_chunk_before_a_decode(pad_to: int | None) -> None:
    chunk = ReqStep("chunk", row=2, start=5, length=1, out_slots=(9,), sample=False)
    decode = ReqStep("decode", row=1, start=7, length=1, out_slots=(10,), sample=True)
    later = ReqStep("later", row=3, start=3, length=1, out_slots=(11,), sample=True)
    batch = StepPlan(1, (chunk, decode, later), (), (), is_decode=True)
    assert _sampled_tokens(batch, pad_to) == [107, 303]


def test_extend_step_samples_the_last_token_of_each_sampling_request() -> None:
    first = ReqStep("a", row=0, start=0, length=3, out_slots=(1, 2, 3), sample=False)
    second = ReqStep("b", row=1, start=2, length=2, out_slots=(4, 5), sample=True)
    third = ReqStep("c", row=2, start=0, length=1, out_slots=(6,), sample=True)
    batch = StepPlan(1, (first, second, third), (), (), is_decode=False)
    inputs = build_step_inputs(batch, _tables(), pad_to=None, staging=STAGING)
    assert inputs.input_ids[inputs.logits_index[:2]].tolist() == [103, 200]
    assert inputs.num_sampled == 2


def test_padded_width_is_the_graph_shape() -> None:
    """Static decode graphs see every padded row; extend graphs never see a dimension of 1."""
    decode = ReqStep("d", row=0, start=4, length=1, out_slots=(1,), sample=True)
    assert build_step_inputs(
        StepPlan(1, (decode,), (), (), True), _tables(), 4, STAGING
    ).logits_index.shape == (4,)
    one = ReqStep("e", row=0, start=0, length=3, out_slots=(1, 2, 3), sample=True)
    assert build_step_inputs(
        StepPlan(1, (one,), (), (), False), _tables(), None, STAGING
    ).logits_index.shape == (2,)


def test_table_writes_and_sampled_tokens_land_in_their_row_or_nowhere() -> None:
    """The tables are written through flat indices: a run past its row's end is refused, not wrapped
    into the next row."""
    from compiled_engine.runner.step_inputs import sample_targets

    tables = _tables()
    token_writes = (TokenWrite(1, 14, (7, 8)), TokenWrite(2, 0, ()))
    sampled = tables.apply_writes(
        StepPlan(0, (), (), token_writes, False), STAGING, [tables.flat(3, 15)]
    )
    assert tables.tokens[1, 13:].tolist() == [113, 7, 8] and tables.tokens[2, 0].item() == 200
    assert sampled.tolist() == [3 * 16 + 15]
    with pytest.raises(IndexError, match="outside the token table"):
        tables.apply_writes(StepPlan(0, (), (), (TokenWrite(1, 15, (1, 2)),), False), STAGING)
    assert tables.tokens[2, 0].item() == 200
    last = ReqStep("z", row=0, start=15, length=1, out_slots=(9,), sample=True)
    with pytest.raises(IndexError):
        sample_targets(StepPlan(1, (last,), (), (), True), tables)


def test_a_decode_step_is_written_into_a_captured_graphs_buffers() -> None:
    """What a CUDA-graph replay reads: the step's inputs land in the static inputs built at capture
    (same tensors, new values), so that the replay copies nothing."""
    tables = _tables()
    capture = tuple(ReqStep(f"w{i}", i, 0, 1, (-1,), True) for i in range(4))
    static = build_step_inputs(StepPlan(-1, capture, (), (), True), tables, 4, STAGING)
    buffers = [
        static.input_ids,
        static.positions,
        static.logits_index,
        static.meta.page_table,
        static.meta.seq_lens,
        static.meta.out_slots,
        static.meta.cu_q_lens,
    ]
    step = (ReqStep("a", 2, 5, 1, (9,), True), ReqStep("b", 0, 3, 1, (8,), True))
    inputs = build_step_inputs(StepPlan(1, step, (), (), True), tables, 4, STAGING, into=static)
    assert inputs.staged is static.staged
    got = [
        inputs.input_ids,
        inputs.positions,
        inputs.logits_index,
        inputs.meta.page_table,
        inputs.meta.seq_lens,
        inputs.meta.out_slots,
        inputs.meta.cu_q_lens,
    ]
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in buffers]
    # rows 2 and 0, then the all-zero padding row
    assert static.input_ids.tolist() == [205, 3, 0, 0]
    assert static.positions.tolist() == [5, 3, 0, 0] and static.meta.seq_lens.tolist() == [
        6,
        4,
        0,
        0,
    ]
    assert static.meta.out_slots.tolist() == [9, 8, -1, -1]
    with pytest.raises(ValueError, match="do not fit"):
        build_step_inputs(StepPlan(2, step, (), (), True), tables, 2, STAGING, into=static)
