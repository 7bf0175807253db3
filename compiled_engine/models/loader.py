"""Building a model from a local checkpoint: a Hugging Face checkpoint directory or a GGUF file.

    model, config = load_model("/path/to/checkpoint", dtype="auto", device="cpu",
        load_format="auto")

Weights stream tensor by tensor from the `*.safetensors` file(s) (`model.safetensors.index.json`
when sharded; each tensor is narrowed to this TP rank's part before it is read, so peak host memory
stays about one tensor above the model) or from the GGUF file (each tensor dequantized in turn,
`models.gguf_checkpoint`). Every problem with the checkpoint is a `CheckpointError` (a `ValueError`)
naming the file, tensor or architecture at fault.
"""

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from compiled_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from compiled_engine.layers.linear import QUANTIZATIONS, quantize_linears
from compiled_engine.layers.moe import expert_checkpoint_names, expert_target
from compiled_engine.layers.weight_utils import WeightSource, default_weight_loader
from compiled_engine.models.errors import CheckpointError
from compiled_engine.models.gguf_checkpoint import is_gguf, open_gguf
from compiled_engine.models.registry import UnsupportedArchitectureError, get_model_class
from kernels import ops
from kernels.packed import PackedWeight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATION_CHOICES = (None, "none", *QUANTIZATIONS)
# Checkpoint entries that are derived buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig) -> torch.dtype:
    """`auto` follows the config's `dtype` (`torch_dtype`), defaulting to float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        if isinstance(dtype, torch.dtype):
            return dtype
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Model (eval mode, this TP rank's shard) and its Hugging Face config. `load_format="dummy"`
    gives deterministic random weights (from `seed`) instead of reading the checkpoint.
    `quantization`: None keeps a GGUF file's block-quantized tensors packed (and any other weight
    as it is); "none" dequantizes them at load; "int8" / "int4" also quantize every dense linear
    weight (`layers.linear.quantize_linears`)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r}; use auto, safetensors or dummy")
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unsupported quantization {quantization!r}; use one of "
            f"{', '.join(c for c in QUANTIZATION_CHOICES if c)}"
        )
    config = load_config(model_dir)
    try:
        model_cls = get_model_class(getattr(config, "architectures", None))
    except UnsupportedArchitectureError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    with torch.device(device), _default_dtype(resolve_dtype(dtype, config)):
        model = model_cls(config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(
            model,
            model_dir,
            tied=getattr(config, "tie_word_embeddings", False),
            keep_packed=quantization != "none",
        )
    if quantization in QUANTIZATIONS:
        quantize_linears(model, quantization)
    for weight in _packed_linear_weights(model):
        ops.prepare_packed(weight, model.dtype)
    return model.eval(), config


def _packed_linear_weights(model: nn.Module) -> list[PackedWeight]:
    """The packed weights a linear reads (a tied LM head's included), not those only looked up by
    an embedding: those stay in the file's layout, whose rows read directly."""
    lookups = {id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    return [m for m in model.modules()
            if isinstance(m, PackedWeight) and (id(m) not in lookups or id(m) in heads)]


def load_config(model_path: str) -> PretrainedConfig:
    """The Hugging Face config of a checkpoint directory, or the one a GGUF file's metadata
    gives."""
    if is_gguf(model_path):
        return open_gguf(model_path).config()
    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the config of {model_path}: {e}") from e


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small uniform weights (norm scales 1), the same for a given seed on every device and rank."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.copy_(torch.empty(param.shape).uniform_(-0.05, 0.05, generator=gen))


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [os.path.join(model_dir, n) for n in names]
        for path in files:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: listed in {index} but missing")
        return files
    files = sorted(
        os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")
    )
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _target(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint tensor name -> (our parameter name, shard id)."""
    expert = expert_target(name)
    if expert is not None:
        return expert
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})
    by_fused: dict[str, list[str]] = {}
    for ckpt, (fused, _) in packed.items():
        by_fused.setdefault(fused, []).append(ckpt)
    names = set()
    for pname, param in model.named_parameters():
        experts = expert_checkpoint_names(pname, param.shape[0])
        if experts is not None:
            names.update(experts)
            continue
        parts = pname.split(".")
        fused = next((i for i, p in enumerate(parts) if p in by_fused), None)
        if fused is None:
            names.add(pname)
        else:
            names.update(
                ".".join([*parts[:fused], c, *parts[fused + 1 :]]) for c in by_fused[parts[fused]]
            )
    return names


def checkpoint_tensors(
    model_path: str, keep_packed: bool = True
) -> Iterator[tuple[str, str, WeightSource]]:
    """(file, tensor name, tensor, lazy slice or packed source) for every tensor of the
    checkpoint."""
    if is_gguf(model_path):
        checkpoint = open_gguf(model_path)
        for name, tensor in tqdm(
            checkpoint.tensors(keep_packed),
            total=checkpoint.num_tensors,
            desc="Loading GGUF",
            unit="tensor",
        ):
            yield model_path, name, tensor
        return
    for path in tqdm(checkpoint_files(model_path), desc="Loading safetensors", unit="file"):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise CheckpointError(f"{path}: cannot open safetensors file ({e})") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield path, name, f.get_slice(name)


def load_weights(
    model: nn.Module, model_path: str, tied: bool = False, keep_packed: bool = True
) -> None:
    packed = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    expected = expected_checkpoint_names(model)
    loaded: set[str] = set()
    for path, name, src in checkpoint_tensors(model_path, keep_packed):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        pname, shard_id = _target(name, packed)
        if name not in expected or pname not in params:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for {type(model).__name__}")
        param = params[pname]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, src, shard_id)
        except Exception as e:
            raise CheckpointError(f"{path}: tensor {name!r}: {e}") from e
        loaded.add(name)
    for module in list(model.modules()):
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"{model_path}: missing tensors {shown}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as this rank holds them: parameters and packed blocks, each
    tensor once (a tied LM head shares the embedding's)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *(m.blocks for m in model.modules()
                                      if isinstance(m, PackedWeight))]
    for t in tensors:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
