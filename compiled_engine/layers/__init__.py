"""Tensor-parallel building blocks of the models (world size 1 is the trivial case)."""
