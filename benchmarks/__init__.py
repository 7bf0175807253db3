"""Benchmarks, each run side by side with its baseline: offline throughput, decode latency, online
serving, prefix sharing, speculation, routers, warm-up (`compiled-engine bench ...`, cli.py), and
the stand-alone A/B runs (`python -m benchmarks.NAME`: llama_cpp, packed, packed_kernel,
prefix_step_times, moe_grouped_vs_loop, moe_decode_share). Results: docs/benchmarks.md."""
