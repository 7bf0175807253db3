"""The error every checkpoint problem raises (a file, tensor, key or architecture we cannot
load)."""


class CheckpointError(ValueError):
    pass
