"""torch.distributed state shared by the TP ranks."""
