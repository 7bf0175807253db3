"""Which graph a decode batch runs: its bucket (the CPU keeps a 1-row graph; CUDA captures every
bucket from the dynamic-batch graph, so its smallest is 2 rows), else the dynamic-batch graph; and
which extend steps the warm-up runs so that every Triton extend variant is compiled before
serving."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.runner.buckets import default_buckets, next_bucket, parse_buckets
from compiled_engine.runner.compiled_forward import CompiledForward
from kernels import ops


def _forward(device: str, buckets: list[int], enabled: bool = True) -> CompiledForward:
    # Nothing is compiled or allocated until a first step: a CUDA forward can be built without a
    # GPU.
    return CompiledForward(torch.nn.Identity(), buckets, enabled, torch.device(device))


def test_default_buckets_follow_mini_sglang() -> None:
    assert default_buckets(0) == []
    assert default_buckets(1) == [1]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(256)[:5] == [1, 2, 4, 8, 16] and default_buckets(256)[-1] == 256
    assert len(default_buckets(256)) == 35


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (9, 16), (16, 16), (17, None)])
def test_next_bucket_is_the_smallest_that_fits(n: int, bucket: int | None) -> None:
    assert next_bucket([1, 2, 4, 8, 16], n) == bucket


def test_parse_buckets_sorts_and_rejects_nonpositive() -> None:
    assert parse_buckets("8, 2,2,1") == [1, 2, 8]
    with pytest.raises(ValueError):
        parse_buckets("0,4")


def test_cpu_keeps_its_one_row_graph_then_the_dynamic_graph_at_two_rows_or_more() -> None:
    fwd = _forward("cpu", [1])
    assert fwd.buckets == [1]
    assert [(g.n_rows, g.key) for g in map(fwd.graph_for, (1, 2, 5))] == [
        (1, 1),
        (2, "decode"),
        (5, "decode"),
    ]


def test_cuda_buckets_start_at_two_rows() -> None:
    fwd = _forward("cuda", default_buckets(20))
    assert fwd.buckets == [2, 4, 8, 16, 20]
    assert [fwd.graph_for(n).n_rows for n in (1, 2, 3, 17, 20, 21)] == [2, 2, 4, 20, 20, 21]
    assert fwd.graph_for(21).key == "decode"  # beyond the largest bucket: the dynamic-batch graph
    assert fwd.graph_for(2).inputs is None  # nothing captured yet


def test_eager_pads_nothing() -> None:
    fwd = _forward("cuda", [1, 2, 4], enabled=False)
    assert fwd.buckets == [] and fwd.graph_for(1).n_rows == 1 and fwd.graph_for(3).n_rows == 3


def test_warm_up_extend_steps_cover_every_triton_request_block() -> None:
    from kernels.triton.attention import extend_block_b

    for max_requests in (3, 16, 17, 257, 1025):
        counts = ops.extend_request_counts(max_requests, torch.device("cuda"))
        reachable = {extend_block_b(n) for n in range(1, max_requests + 1)}
        assert {extend_block_b(n) for n in counts} == reachable
        assert max(counts) <= max_requests
    assert ops.extend_request_counts(257, torch.device("cpu")) == []
