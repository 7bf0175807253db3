"""The model tests run forwards outside an engine: the CPU ops are then the native ones only after
`kernels.init`, as the engine builder calls it (else which kernels run would depend on whether an
earlier test built an engine)."""

import torch

import kernels

kernels.init("cuda" if torch.cuda.is_available() else "cpu")
