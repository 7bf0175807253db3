"""What several test modules share (a test module never imports another): servers, the transformers
oracle, checkpoints, kernel batches, packed weights, CPU families, the parity, determinism, MoE and
structured-output tests' settings."""
