"""The `compiled-engine` command (main.py: serve, generate, chat, warmup, bench, demo-model) and the
JSONL entry for TP across hosts under torchrun (torchrun_entry.py)."""
