"""`kernels::linear`: bf16 weights prepared once (the AMX kernel where the CPU has it, else oneDNN's
packed bf16 or fp32 layouts), against fp32 math and torch's own linear."""

import pytest
import torch
import torch.nn.functional as F

from kernels import ops


@pytest.mark.parametrize(
    ("shape", "n", "k"),
    [
        ((1,), 2048, 768),
        ((3,), 100, 72),
        ((2, 5), 64, 256),
        ((64,), 33, 40),
        ((37,), 200, 96),
        ((0,), 64, 64),
        # the last two: big GEMMs, which the C++ op hands to oneDNN
        ((2, 400), 1100, 64),
        ((2048,), 64, 96),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp32_within_bf16_rounding(
    shape: tuple, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(*shape, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = ops.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape, n)
    if x.numel():
        _assert_within_bf16_rounding(out, x, w, b)


def _assert_within_bf16_rounding(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch_error = (F.linear(x, w, b).float() - expected).abs().max()
    assert (out.float() - expected).abs().max() <= max(2 * torch_error, 1e-2 * expected.abs().max())


amx_only = pytest.mark.skipif(not ops.amx_available(), reason="no AMX bf16 on this CPU / build")


@amx_only
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 40, 63, 64, 81])
def test_amx_kernel_row_blocks_and_column_tail(rows: int) -> None:
    """Rows run in blocks of 32, then 16, and columns in panels of 64: partial blocks and a partial
    last panel."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=gen).bfloat16()
    w = torch.randn(72, 128, generator=gen).bfloat16()
    b = torch.randn(72, generator=gen).bfloat16()
    _assert_within_bf16_rounding(ops.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("k", [64, 40])  # AMX takes K % 32 == 0; 40 goes to oneDNN's layouts there
def test_strided_inputs_and_every_route(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(k, 6, generator=gen).bfloat16().t()  # [6, k], not contiguous
    w = torch.randn(24, k, generator=gen).bfloat16()
    # the C++ kernel, when the library loaded
    _assert_within_bf16_rounding(ops.linear(x, w), x, w, None)
    _assert_within_bf16_rounding(torch.ops.kernels.linear_portable(x, w), x, w, None)  # torch's own


def test_weight_changed_in_place_is_repacked() -> None:
    w = torch.randn(16, 32).bfloat16()
    x = torch.randn(2, 32).bfloat16()
    first = ops.linear(x, w)
    w.mul_(-1)
    torch.testing.assert_close(ops.linear(x, w), -first)


def test_a_new_weight_at_a_freed_weights_address_is_not_confused_with_it() -> None:
    """The prepared copies are keyed by the weight's storage object: a freed weight's entry must not
    serve a new weight, even where the allocator hands out the same address."""
    x = torch.randn(3, 64).bfloat16()
    for seed in range(4):
        w = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
        _assert_within_bf16_rounding(ops.linear(x, w), x, w, None)
        del w


def test_fp32_is_torch_linear() -> None:
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


def test_bf16_linear_layer_compiles_as_one_graph() -> None:
    """The packing decision is a constant to torch.compile, so a bf16 model compiles without graph
    breaks."""
    w = torch.randn(32, 64).bfloat16()
    fn = torch.compile(lambda x: ops.linear(x, w) * 2, fullgraph=True)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(fn(x), F.linear(x, w) * 2, atol=2e-2, rtol=2e-2)


def test_frozen_graphs_leave_bf16_linears_to_inductor() -> None:
    """Under freezing, inductor packs the (constant) weights and may pick its GEMM templates: the
    linear must stay a plain matmul in the graph, not the opaque op."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.testing import EagerAndRecordGraphs

    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(2, 64).bfloat16()

    def targets(freezing: bool) -> set[str]:
        torch._dynamo.reset()
        backend = EagerAndRecordGraphs()
        with inductor_config.patch(freezing=freezing):
            torch.compile(lambda x: ops.linear(x, w), backend=backend, fullgraph=True)(x)
        return {
            str(n.target) for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"
        }

    assert any("kernels.linear" in t for t in targets(False))
    frozen = targets(True)
    assert not any("kernels.linear" in t for t in frozen) and any("linear" in t for t in frozen)
