"""Benchmarks: offline throughput, decode latency, online serving, prefix sharing (`compiled-engine
bench`)."""
