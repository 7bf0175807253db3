"""Tools over the engine: the console script, warm-up, torchrun entry and the benchmarks."""
