"""Without CUDA the Triton kernels run in the interpreter, which must be chosen before triton decorates
any kernel: set it before the tests import. CI may export TRITON_INTERPRET=1 itself."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
