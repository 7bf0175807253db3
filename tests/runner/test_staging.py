"""The staging buffers: a step's host lists reach the device intact, each field a tensor of its own,
into a graph's static buffers when asked, and a host buffer is rewritten only after its copy has
run: the ring grows instead of waiting."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.runner.staging import Staging, to_device

CPU = torch.device("cpu")


class FakeEvent:
    """A device event whose completion the test decides; it fails the test if anyone waits on it."""

    made: list[FakeEvent] = []

    def __init__(self) -> None:
        self.recorded = False
        self.done = False
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("a staging upload waited on the device")


def fields(n: int) -> dict:
    return {"positions": (list(range(n)), torch.long), "seq_lens": ([7] * (n + 1), torch.int32),
            "rows": ([3, 1, 2][: max(n, 1)], torch.long), "empty": ([], torch.long)}


def test_upload_round_trips_every_field_with_its_dtype() -> None:
    up = Staging(CPU).upload(fields(5))
    assert up.fields["positions"].tolist() == [0, 1, 2, 3, 4]
    assert up.fields["seq_lens"].dtype == torch.int32 and up.fields["seq_lens"].tolist() == [7] * 6
    assert up.fields["rows"].tolist() == [3, 1, 2]
    assert up.fields["empty"].numel() == 0


@pytest.mark.parametrize("n", [1, 3, 17])
def test_every_field_is_a_tensor_of_its_own(n: int) -> None:
    """Graph inputs that were views into one buffer would be guarded on their storage offsets."""
    up = Staging(CPU).upload(fields(n))
    storages = [t.untyped_storage().data_ptr() for t in up.fields.values() if t.numel()]
    assert len(set(storages)) == len(storages)
    assert all(t.storage_offset() == 0 for t in up.fields.values())


def test_upload_into_static_buffers_writes_them_in_place() -> None:
    staging = Staging(CPU)
    static = staging.upload(fields(4))
    pointers = {name: t.data_ptr() for name, t in static.fields.items()}
    again = fields(4)
    again["positions"] = ([9, 8, 7, 6], torch.long)
    out = staging.upload(again, into=static)
    assert out is static
    assert {name: t.data_ptr() for name, t in static.fields.items()} == pointers
    assert static.fields["positions"].tolist() == [9, 8, 7, 6]


def test_inputs_that_do_not_fit_the_static_buffers_are_refused() -> None:
    staging = Staging(CPU)
    static = staging.upload(fields(4))
    with pytest.raises(ValueError, match="do not fit"):
        staging.upload(fields(5), into=static)


def test_a_buffer_whose_copy_is_in_flight_is_not_reused_nor_waited_for() -> None:
    FakeEvent.made.clear()
    staging = Staging(CPU, ring=2, make_event=FakeEvent)
    first = staging.upload(fields(3))
    staging.upload(fields(3))
    assert staging.ring_size == 2
    staging.upload(fields(3))  # both buffers' copies are in flight: a third buffer, no wait
    assert staging.ring_size == 3
    assert all(e.recorded for e in FakeEvent.made)
    assert first.fields["positions"].tolist() == [0, 1, 2]  # the device data is the step's own
    for event in FakeEvent.made:
        event.done = True
    for _ in range(6):  # copies done: the ring is reused, not grown
        staging.upload(fields(3))
        FakeEvent.made[-1].done = True
    assert staging.ring_size == 3


def test_to_device_keeps_values_and_dtype() -> None:
    t = to_device([1.5, 2.0], torch.float32, CPU)
    assert t.dtype == torch.float32 and t.tolist() == [1.5, 2.0]
    assert to_device([True, False], torch.bool, CPU).tolist() == [True, False]
