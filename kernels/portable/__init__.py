"""The portable torch implementations of the ops: every device, every CPU; where the native kernels
decline."""
