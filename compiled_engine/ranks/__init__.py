"""The TP rank processes: wire messages, the rank loop, the launcher and its monitor, the remote
engine."""
