"""torch <-> JAX over DLPack, zero-copy on the same device, and the application of one JAX logits processor.

A processor is a function `f(token_ids, logits) -> logits`, as vLLM's classic processors, on JAX arrays:
`token_ids` the request's tokens so far (prompt, then output; int32), `logits` its logits row (float32,
vocabulary-sized). It may be jitted. The logits row reaches it as a view of the engine's tensor (same memory:
`to_jax`); its result comes back the same way and is copied into the row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Processor = Callable[..., object]


class ProcessorError(ValueError):
    """A logits processor raised, or returned something that is not a logits row."""


def to_jax(t: torch.Tensor):
    """`t` as a JAX array on the same device, sharing its memory (DLPack)."""
    import jax.dlpack

    return jax.dlpack.from_dlpack(t.detach())


def to_torch(a) -> torch.Tensor:
    """A JAX array as a torch tensor on the same device, sharing its memory (DLPack)."""
    return torch.from_dlpack(a)


def apply(processor: Processor, token_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Run `processor` on one request's history and logits row (1-D float32, contiguous) and write its result
    into the row; ProcessorError (the row untouched) if it fails or returns the wrong shape or dtype."""
    try:
        result = processor(to_jax(token_ids.to(torch.int32)), to_jax(logits))
    except Exception as e:  # noqa: BLE001 - any failure of user code fails its request only
        raise ProcessorError(f"logits processor {_name(processor)} raised {type(e).__name__}: {e}") from e
    shape, dtype = tuple(getattr(result, "shape", ())), str(getattr(result, "dtype", type(result).__name__))
    if shape != tuple(logits.shape) or not dtype.startswith(("float", "bfloat")):
        raise ProcessorError(f"logits processor {_name(processor)} returned {dtype}{list(shape)}; "
                             f"expected float{list(logits.shape)} (one logits row)")
    logits.copy_(to_torch(result))


def _name(processor: Processor) -> str:
    return getattr(processor, "__name__", None) or type(processor).__name__
