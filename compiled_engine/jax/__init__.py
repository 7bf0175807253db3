"""JAX interop (the `[jax]` extra): per-request logits processors written in JAX, handed the
engine's tensors without a copy (`bridge`). Nothing here imports JAX until a processor runs."""
