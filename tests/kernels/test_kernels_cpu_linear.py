"""`kernels::cpu_linear`: oneDNN on pre-packed bf16 weights, against fp32 math and torch's own linear."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear, ops

pytestmark = pytest.mark.skipif(not cpu_linear.packing_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize(("shape", "n", "k"), [((1,), 2048, 768), ((3,), 100, 72), ((2, 5), 64, 256), ((64,), 33, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp32_within_bf16_rounding(shape: tuple, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(*shape, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = ops.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape, n)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch_error = (F.linear(x, w, b).float() - expected).abs().max()
    assert (out.float() - expected).abs().max() <= max(2 * torch_error, 1e-2 * expected.abs().max())


def test_weight_changed_in_place_is_repacked() -> None:
    w = torch.randn(16, 32).bfloat16()
    x = torch.randn(2, 32).bfloat16()
    first = ops.linear(x, w)
    w.mul_(-1)
    torch.testing.assert_close(ops.linear(x, w), -first)


def test_fp32_is_torch_linear() -> None:
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


def test_bf16_linear_layer_compiles_as_one_graph() -> None:
    """The packing decision is a constant to torch.compile, so a bf16 model compiles without graph breaks."""
    from compiled_engine.layers.linear import linear

    w = torch.randn(32, 64).bfloat16()
    fn = torch.compile(lambda x: linear(x, w) * 2, fullgraph=True)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(fn(x), F.linear(x, w) * 2, atol=2e-2, rtol=2e-2)


def test_frozen_graphs_leave_bf16_linears_to_inductor() -> None:
    """Under freezing, inductor packs the (constant) weights and may pick its GEMM templates: the linear
    must stay a plain matmul in the graph, not the opaque op."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.testing import EagerAndRecordGraphs

    from compiled_engine.layers.linear import linear

    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(2, 64).bfloat16()

    def targets(freezing: bool) -> set[str]:
        torch._dynamo.reset()
        backend = EagerAndRecordGraphs()
        with inductor_config.patch(freezing=freezing):
            torch.compile(lambda x: linear(x, w), backend=backend, fullgraph=True)(x)
        return {str(n.target) for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"}

    assert any("cpu_linear" in t for t in targets(False))
    frozen = targets(True)
    assert not any("cpu_linear" in t for t in frozen) and any("linear" in t for t in frozen)
