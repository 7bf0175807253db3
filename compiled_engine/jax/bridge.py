"""torch <-> JAX over DLPack, zero-copy on the same device, and the application of one JAX logits
processor.

A processor is a function `f(token_ids, logits) -> logits`, as vLLM's classic processors, on JAX
arrays, or its name `"package.module:function"` (what a tensor-parallel engine takes: each rank
imports it): `token_ids` the request's tokens so far (prompt, then output; int32), `logits` its
logits row (float32, vocabulary-sized). It may be jitted. The logits row reaches it as a view of the
engine's tensor (same memory: `to_jax`); its result comes back the same way and is copied into the
row.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

Processor = Callable[..., object]


class ProcessorError(ValueError):
    """A logits processor raised, or returned something that is not a logits row."""


def resolve(processor: Processor | str) -> Processor:
    """The function itself, or the one a `"module:function"` name points to (imported once);
    ValueError if the name leads nowhere."""
    if callable(processor):
        return processor
    if not isinstance(processor, str):
        raise ValueError(
            f"logits processor {processor!r} is neither a function nor a 'module:function' name"
        )
    return _import(processor)


@functools.cache
def _import(name: str) -> Processor:
    module, _, attr = name.partition(":")
    try:
        target = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"logits processor {name!r}: cannot import it ({type(e).__name__}: {e})"
        ) from e
    if not callable(target):
        raise ValueError(f"logits processor {name!r} is not a function")
    return target


def to_jax(t: torch.Tensor):
    """`t` as a JAX array on the same device, sharing its memory (DLPack)."""
    import jax.dlpack

    return jax.dlpack.from_dlpack(t.detach())


def to_torch(a) -> torch.Tensor:
    """A JAX array as a torch tensor on the same device, sharing its memory (DLPack)."""
    return torch.from_dlpack(a)


def apply(processor: Processor, token_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Run `processor` on one request's history and logits row (1-D float32, contiguous) and write
    its result into the row; ProcessorError (the row untouched) if it fails or returns the wrong
    shape or dtype."""
    try:
        result = processor(to_jax(token_ids.to(torch.int32)), to_jax(logits))
    except Exception as e:  # noqa: BLE001 - any failure of user code fails its request only
        raise ProcessorError(
            f"logits processor {_name(processor)} raised {type(e).__name__}: {e}"
        ) from e
    shape, dtype = (
        tuple(getattr(result, "shape", ())),
        str(getattr(result, "dtype", type(result).__name__)),
    )
    if shape != tuple(logits.shape) or not dtype.startswith(("float", "bfloat")):
        raise ProcessorError(f"logits processor {_name(processor)} returned {dtype}{list(shape)}; "
                             f"expected float{list(logits.shape)} (one logits row)")
    logits.copy_(to_torch(result))


def _name(processor: Processor) -> str:
    return getattr(processor, "__name__", None) or type(processor).__name__
