"""Shared by the TP tests: ragged prompts with shared prefixes, transformers' greedy oracle, and a
tiny Qwen3 checkpoint (with the demo tokenizer, so `LLM` can load it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from compiled_engine.models.demo import demo_model_dir
from tests.helpers.checkpoints import make_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def ragged_prompts(n: int, vocab: int, max_len: int = 80) -> list[list[int]]:
    """Lengths spread over 1..max_len; a third share a 24-token prefix, a third a 5-token one; the
    last two repeat earlier prompts (radix hits inside one batch)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731
    heads = (rand(24), rand(5), [])
    prompts = []
    for i in range(n - 2):
        length = 1 + (i * (max_len - 1)) // (n - 3)
        head = heads[i % 3][:length]
        prompts.append(head + rand(length - len(head)))
    return prompts + [prompts[3 % len(prompts)], prompts[7 % len(prompts)]]


def hf_greedy(model_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def demo_dir() -> str:
    return str(demo_model_dir())


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, demo_dir: str) -> str:
    path = make_checkpoint(
        str(tmp_path_factory.mktemp("qwen3")), "Qwen3ForCausalLM", tie_word_embeddings=True
    )
    for name in TOKENIZER_FILES:
        shutil.copy(Path(demo_dir) / name, Path(path) / name)
    return path
