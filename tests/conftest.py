"""Without CUDA the Triton kernels run in the interpreter, which must be chosen before triton reads its
settings: set here, before any test module or other conftest imports the engine (importing inductor reads
them; a kernels-only conftest was too late when another test folder ran first). CI exports
TRITON_INTERPRET=1 itself."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
