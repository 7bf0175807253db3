"""The built-in demo checkpoint: deterministic, standard HF layout, usable by transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from compiled_engine.models.demo import DEMO_CONFIG, demo_model_dir


def digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return demo_model_dir(tmp_path_factory.mktemp("a"))


def test_two_fresh_caches_give_byte_identical_files(demo: Path, tmp_path: Path) -> None:
    again = demo_model_dir(tmp_path)
    assert digest(demo) == digest(again)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(digest(demo))


def test_second_call_reuses_the_existing_checkpoint(demo: Path) -> None:
    before = (demo / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir(demo.parent) == demo
    assert (demo / "model.safetensors").stat().st_mtime_ns == before


def test_transformers_loads_it_and_the_chat_template_has_one_bos(demo: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(demo)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 4, 8000)
    tok = AutoTokenizer.from_pretrained(demo)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(demo)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), DEMO_CONFIG["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "text", ["def f(x):\n    return  x + 1\n", "héllo wörld 你好 🙂", "  leading spaces"]
)
def test_tokenizer_round_trips_text(demo: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
