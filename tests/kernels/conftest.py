"""The kernel tests call the ops directly, as an engine would after `kernels.init`: without it the
CPU ops would silently be the portable ones."""

import torch

import kernels

kernels.init("cuda" if torch.cuda.is_available() else "cpu")
