"""What several test folders share: servers, the transformers oracle, checkpoints, kernel
batches."""
