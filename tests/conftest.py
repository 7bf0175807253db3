"""Without CUDA the Triton kernels run in the interpreter, which must be chosen before triton reads its
settings: set here, before any test module or other conftest imports the engine (importing inductor reads
them; a kernels-only conftest was too late when another test folder ran first). CI exports
TRITON_INTERPRET=1 itself."""

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _engines_collectable_after_each_test():
    """`startup.build_engine` freezes everything that exists out of the cyclic GC (a serving process has
    one engine); tests build many in one process, so each test gives its objects back afterwards."""
    yield
    gc.unfreeze()
