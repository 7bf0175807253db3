"""Attention kernels: torch.library custom ops (``kernels.ops``), Triton kernels and a torch reference."""
