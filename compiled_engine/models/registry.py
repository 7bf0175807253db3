"""Architecture name (config.json `architectures`) -> model class. A model file registers itself
with `@register("XForCausalLM")`; every module of this package is imported on the first lookup, so
adding an architecture is adding one file."""

import importlib
import pkgutil
from collections.abc import Callable

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


class UnsupportedArchitectureError(ValueError):
    pass


def register(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            _MODELS[name] = cls
        return cls

    return wrap


def _import_all() -> None:
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")


def supported_architectures() -> list[str]:
    _import_all()
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    _import_all()
    for name in architectures or []:
        if name in _MODELS:
            return _MODELS[name]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures}; supported: {', '.join(sorted(_MODELS))}"
    )
