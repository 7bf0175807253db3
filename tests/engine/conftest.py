"""Shared fixtures: the demo checkpoint, a ragged prompt set with shared prefixes, and transformers'
greedy continuations of it (the correctness oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from compiled_engine.models.demo import demo_model_dir

NEW_TOKENS = 12


def ragged_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 1..90 tokens; a third share a 33-token system prefix, a third a 7-token one."""
    rng = random.Random(seed)
    system = [1] + [rng.randrange(10, 7990) for _ in range(32)]
    short = [1] + [rng.randrange(10, 7990) for _ in range(6)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(10, 7990) for _ in range(rng.randrange(0, 58))]
        head = (system, short, [1])[i % 3]
        prompts.append((head + body) if (head + body) else [1])
    return prompts


@pytest.fixture(scope="session")
def demo_dir() -> str:
    return str(demo_model_dir())


@pytest.fixture(scope="session")
def hf_greedy(demo_dir):
    """prompt tuple -> transformers' greedy continuation (NEW_TOKENS tokens, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    cache: dict[tuple[int, ...], list[int]] = {}

    def continuation(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return continuation
