"""The JAX reference forward (`compiled_engine.jax.llama`), an oracle written independently of the
engine's model code: its greedy tokens equal transformers' for Llama, Qwen2, Qwen3 and Mistral
checkpoints in fp32, with tied embeddings and a sliding window too, and log-probabilities within
1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compiled_engine.jax.llama import JaxLlama, bucket
from tests.helpers.checkpoints import MODEL_TYPES, make_checkpoint
from tests.helpers.oracle import hf_fp32_greedy

PROMPTS = [list(range(3, 40)), [7, 11, 13, 17], [5]]
NEW_TOKENS = 10


def _agree(path: str, prompts: list[list[int]] = PROMPTS) -> None:
    refs = hf_fp32_greedy(path, prompts, NEW_TOKENS)
    model = JaxLlama(path)
    for prompt, ref in zip(prompts, refs, strict=True):
        tokens, logprobs = model.greedy(prompt, NEW_TOKENS)
        assert tokens == ref.tokens
        assert np.abs(logprobs - ref.logprobs.numpy()).max() < 1e-4


# the JAX reference forward is a dense decoder's (no mixture of experts)
@pytest.mark.parametrize("arch", sorted(a for a in MODEL_TYPES if "Moe" not in a))
def test_greedy_tokens_equal_transformers(tmp_path: Path, arch: str) -> None:
    _agree(make_checkpoint(str(tmp_path), arch))


def test_tied_embeddings(tmp_path: Path) -> None:
    _agree(make_checkpoint(str(tmp_path), "Qwen3ForCausalLM", tie_word_embeddings=True))


def test_sliding_window(tmp_path: Path) -> None:
    """Mistral attends to its last 8 keys only: prompts longer than the window decide
    differently."""
    _agree(
        make_checkpoint(str(tmp_path), "MistralForCausalLM", sliding_window=8), [list(range(3, 40))]
    )


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    path = make_checkpoint(str(tmp_path), "LlamaForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only the default rotary embedding"):
        JaxLlama(path)


def test_lengths_share_a_few_compiled_buckets() -> None:
    assert [bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
