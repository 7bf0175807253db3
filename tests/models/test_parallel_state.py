import torch

from compiled_engine.parallel import parallel_state as ps


def test_single_rank_defaults_are_no_ops() -> None:
    assert (ps.get_tp_rank(), ps.get_tp_size(), ps.get_tp_group()) == (0, 1, None)
    x = torch.arange(6.0).view(2, 3)
    assert ps.all_reduce(x) is x
    assert ps.all_gather(x, dim=-1) is x
