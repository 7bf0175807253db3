"""Random packed weights (GGUF block formats, `--quantization`'s I8 / I4, interleaved or not)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.interleave import interleave
from kernels.packed import FORMATS, PackedWeight, quantize

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in `name`'s layout with finite, small fp16 scales: [n, row bytes]."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scale = rng.uniform(-0.01, 0.01, size=(n, k // fmt.block, 1)).astype(np.float16)
        b[..., at : at + 2] = scale.view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def packed(name: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """A random weight in format `name` (a `<base>x16` name: interleaved)."""
    base = name.removesuffix("x16")
    if base in ("I8", "I4"):
        gen = torch.Generator().manual_seed(seed)
        w = quantize(torch.randn(n, k, generator=gen) * 0.05, FORMATS[base])
    else:
        w = PackedWeight(random_blocks(base, n, k, seed), FORMATS[base], k)
    if name != base:
        w.relayout(interleave(w.blocks, w.format), FORMATS[name])
    return w
