"""Decoder-only models on the TP layers, and their loading from Hugging Face checkpoints.

`load_model` lives in `compiled_engine.models.loader`; architectures register in `registry`.
"""
