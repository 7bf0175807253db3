"""compiled-engine: an LLM serving engine.

Public names are imported lazily so that `compiled_engine.scheduler` (pure Python) can be imported
without pulling in torch.
"""

from importlib import import_module

_LAZY = {
    "LLM": "compiled_engine.llm",
    "SamplingParams": "compiled_engine.sampling_params",
    "EngineConfig": "compiled_engine.config",
    "LoRARequest": "compiled_engine.lora.request",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'compiled_engine' has no attribute {name!r}")
