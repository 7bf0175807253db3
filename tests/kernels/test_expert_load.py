"""`kernels.expert_load` on a device tensor (the CUDA path's totals, which captured graphs add to):
made during the warm-up's inference mode, reset afterwards outside it."""

from __future__ import annotations

import torch

from kernels import expert_load


def test_a_device_total_made_in_inference_mode_resets_outside_it() -> None:
    w13 = torch.zeros(4, 2, 2)
    with torch.inference_mode():
        expert_load.record(w13, torch.tensor([1, 0, 2, 0]))
    assert expert_load.tokens(w13) == [1, 0, 2, 0]
    expert_load.reset(w13)
    assert expert_load.tokens(w13) == [0, 0, 0, 0]
    with torch.inference_mode():
        expert_load.record(w13, torch.tensor([1, 1, 0, 0]))
    assert expert_load.tokens(w13) == [1, 1, 0, 0]
