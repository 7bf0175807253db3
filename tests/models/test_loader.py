"""Loading: dtypes, dummy weights, and clear errors for every kind of bad checkpoint."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_engine.models.loader import CheckpointError, load_model
from compiled_engine.models.registry import supported_architectures
from tests.helpers.checkpoints import make_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM")


def _copy_with(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    """A checkpoint at `dst` with the config of `src` and the given tensors."""
    os.makedirs(dst)
    Path(dst, "config.json").write_text(Path(src, "config.json").read_text())
    save_file(tensors, os.path.join(dst, WEIGHTS))
    return dst


def test_supported_architectures() -> None:
    assert {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
    } <= set(supported_architectures())


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("auto", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_dtype(checkpoint: str, dtype: object, expected: torch.dtype) -> None:
    model, _ = load_model(checkpoint, dtype=dtype)
    assert model.dtype == expected
    assert all(p.dtype == expected for p in model.parameters())
    assert model.model.rotary.cos.dtype == torch.float32


def test_auto_dtype_follows_config(tmp_path) -> None:
    model, _ = load_model(make_checkpoint(str(tmp_path), "Qwen3ForCausalLM", torch.bfloat16))
    assert model.dtype == torch.bfloat16


def test_bad_dtype(checkpoint: str) -> None:
    with pytest.raises(ValueError, match="float64"):
        load_model(checkpoint, dtype="float64")


def test_dummy_weights_are_deterministic(checkpoint: str) -> None:
    a, _ = load_model(checkpoint, load_format="dummy")
    b, _ = load_model(checkpoint, load_format="dummy")
    real, _ = load_model(checkpoint)
    for (name, pa), pb, pr in zip(
        a.named_parameters(), b.parameters(), real.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pr) or "norm" in name


def test_kv_sizing_attributes(checkpoint: str) -> None:
    model, config = load_model(checkpoint)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
    with pytest.raises(ValueError, match="expected 2"):
        model.attach_kv_cache([torch.zeros(1)], [torch.zeros(1)])


def test_truncated_file(checkpoint: str, tmp_path) -> None:
    data = Path(checkpoint, WEIGHTS).read_bytes()
    bad = _copy_with(checkpoint, str(tmp_path / "bad"), {})
    with open(os.path.join(bad, WEIGHTS), "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(bad)


def test_missing_tensor(checkpoint: str, tmp_path) -> None:
    tensors = load_file(os.path.join(checkpoint, WEIGHTS))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(
        CheckpointError, match=r"missing tensors model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        load_model(_copy_with(checkpoint, str(tmp_path / "bad"), tensors))


def test_unexpected_tensor(checkpoint: str, tmp_path) -> None:
    tensors = load_file(os.path.join(checkpoint, WEIGHTS))
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"
    ):
        load_model(_copy_with(checkpoint, str(tmp_path / "bad"), tensors))


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"]
)
def test_wrong_shape(checkpoint: str, tmp_path, name: str) -> None:
    tensors = load_file(os.path.join(checkpoint, WEIGHTS))
    # twice the rows: narrowing must not hide it
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    with pytest.raises(CheckpointError, match=rf"'{name}'.*shape mismatch"):
        load_model(_copy_with(checkpoint, str(tmp_path / "bad"), tensors))


def test_unknown_architecture(checkpoint: str, tmp_path) -> None:
    bad = _copy_with(
        checkpoint, str(tmp_path / "bad"), load_file(os.path.join(checkpoint, WEIGHTS))
    )
    config_path = Path(bad, "config.json")
    config = json.loads(config_path.read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="FancyNetForCausalLM"):
        load_model(bad)


def test_no_weights(checkpoint: str, tmp_path) -> None:
    bad = _copy_with(checkpoint, str(tmp_path / "bad"), {})
    os.remove(os.path.join(bad, WEIGHTS))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(bad)


def test_sharded_index_names_missing_file(tmp_path) -> None:
    path = make_checkpoint(str(tmp_path), "LlamaForCausalLM", max_shard_size="60KB")
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(CheckpointError, match=shards[-1]):
        load_model(path)
