"""The Triton GPU kernels (decode, extend, KV store) behind `kernels.ops` on CUDA."""
