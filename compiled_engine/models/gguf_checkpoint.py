"""A GGUF file (what llama.cpp and Ollama hold) read as a checkpoint: a Hugging Face config built
from its metadata, and its tensors under Hugging Face names, block-quantized ones kept packed (the
file's bytes, `kernels.packed`) and the rest dequantized by the `gguf` package's own routines.

llama.cpp's converter permutes the rows of the Q and K projections of `llama` models (its rotary
pairs adjacent dimensions; Hugging Face's rotates halves); `tensors()` undoes that, as transformers
does when it loads a GGUF file. Qwen2 and Qwen3 files are written unpermuted. A `qwen3moe` file
holds each layer's experts stacked in one tensor per projection ([E, I, H]); `tensors()` gives them
expert by expert under Hugging Face's names. Every problem is a `CheckpointError` naming the file
and what is unsupported or missing.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from compiled_engine.models.errors import CheckpointError

# imported where weights or a config object are asked for: reading metadata needs neither
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from compiled_engine.layers.weight_utils import PackedSource

# GGUF `general.architecture` -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Architectures whose Q/K rows llama.cpp's converter permuted.
PERMUTED_ARCHS = frozenset({"llama"})
_FLOAT_TYPES = ("F32", "F16", "BF16")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The file's checkpoint, parsed once per process (the reader takes seconds on a 49k-token
    vocabulary, and the config, the weights and the tokenizer each need it); a changed file is
    parsed again."""
    where = Path(path).resolve()
    stat = where.stat() if where.is_file() else None
    return _open(where, None if stat is None else (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _open(path: Path, version: tuple[int, int] | None) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


@dataclass
class GGUFCheckpoint:
    path: Path
    _reader: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from gguf import GGUFReader

        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self._reader = GGUFReader(self.path)
        except ValueError as e:
            # the reader's words for a type id it does not know
            if "GGMLQuantizationType" in str(e):
                raise CheckpointError(f"{self.path}: unsupported quantization type ({e})") from e
            raise CheckpointError(
                f"{self.path}: cannot read this GGUF file, truncated or corrupt ({e})"
            ) from e
        except Exception as e:  # noqa: BLE001
            # a truncated file fails in numpy's memmap or struct parsing
            raise CheckpointError(f"{self.path}: cannot read this GGUF file, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from e
        arch = self.metadata("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                  f"(supported: {', '.join(ARCHITECTURES)})")
        self.arch: str = arch

    def metadata(self, key: str, default: object = KeyError) -> object:
        f = self._reader.fields.get(key)
        if f is None:
            if default is KeyError:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return f.contents()

    @cached_property
    def config_dict(self) -> dict:
        """The Hugging Face config of the model, as a plain dict (its JSON is the compile-cache's
        model key)."""
        a, meta = self.arch, self.metadata
        heads = int(meta(f"{a}.attention.head_count"))
        hidden = int(meta(f"{a}.embedding_length"))
        names = {t.name for t in self._reader.tensors}
        scaling = meta(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "linear") or "rope_freqs.weight" in names:
            raise CheckpointError(
                f"{self.path}: rope scaling {scaling!r} (or a rope_freqs tensor) is not supported"
            )
        rope: dict = {
            "rope_type": "default",
            "rope_theta": float(meta(f"{a}.rope.freq_base", 10000.0)),
        }
        if scaling == "linear":
            rope |= {"rope_type": "linear", "factor": float(meta(f"{a}.rope.scaling.factor"))}
        weight_types = {
            t.tensor_type.name for t in self._reader.tensors if t.name.endswith(".weight")
        }
        hf_arch, model_type = ARCHITECTURES[a]
        config = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(meta(f"{a}.vocab_size", None) or len(meta("tokenizer.ggml.tokens"))),
            "hidden_size": hidden,
            "intermediate_size": int(meta(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(meta(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(meta(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(meta(f"{a}.attention.key_length", hidden // heads)),
            "max_position_embeddings": int(meta(f"{a}.context_length")),
            "rms_norm_eps": float(meta(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": meta("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": meta("tokenizer.ggml.eos_token_id", None),
            # `dtype="auto"`: an all-F32 file stays fp32; anything quantized or 16-bit runs in bf16
            "torch_dtype": "float32" if weight_types == {"F32"} else "bfloat16",
        }
        if a == "llama":
            config |= {"attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False}
        if a == "qwen3moe":  # every layer routed, weights renormalized (llama.cpp's qwen3moe graph)
            moe = int(meta(f"{a}.expert_feed_forward_length"))
            config |= {
                "num_experts": int(meta(f"{a}.expert_count")),
                "num_experts_per_tok": int(meta(f"{a}.expert_used_count")),
                "moe_intermediate_size": moe,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        return config

    @cached_property
    def tokenizer_digest(self) -> str:
        """A hash of everything transformers builds the tokenizer from (vocabulary, merges, special
        ids, chat template, and the architecture: transformers' conversion depends on it too):
        files that share a tokenizer share its converted copy."""
        h = hashlib.sha256(self.arch.encode() + b"\0")
        for key in sorted(k for k in self._reader.fields if k.startswith("tokenizer.")):
            h.update(key.encode() + b"\0" + repr(self.metadata(key)).encode() + b"\0")
        return h.hexdigest()[:16]

    def config(self) -> PretrainedConfig:
        from transformers import AutoConfig

        c = dict(self.config_dict)
        return AutoConfig.for_model(c.pop("model_type"), **c)

    @property
    def num_tensors(self) -> int:
        return len(self._reader.tensors)

    def tensors(
        self, keep_packed: bool = True
    ) -> Iterator[tuple[str, torch.Tensor | PackedSource]]:
        """(Hugging Face name, tensor) for every tensor of the file, one at a time: a tensor in a
        block format the kernels know (`kernels.packed`) as a `PackedSource` of the file's bytes
        (`keep_packed`; a stack of experts as one per expert), every other one dequantized to
        fp32 by the `gguf` package."""
        import gguf
        import numpy as np
        import torch

        from compiled_engine.layers.weight_utils import PackedSource
        from kernels.packed import FORMATS

        names = hf_tensor_names(self.arch, int(self.metadata(f"{self.arch}.block_count")))
        c = self.config_dict
        for t in self._reader.tensors:
            hf = names.get(t.name)
            if hf is None:
                raise CheckpointError(
                    f"{self.path}: unexpected tensor {t.name!r} for GGUF architecture {self.arch!r}"
                )
            shape = tuple(int(n) for n in reversed(t.shape))
            fmt = FORMATS.get(t.tensor_type.name)
            if keep_packed and fmt is not None and fmt.name[0] == "Q" and len(shape) in (2, 3):
                blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(*shape[:-1], -1)
                w: torch.Tensor | PackedSource | list[PackedSource] = (
                    PackedSource(blocks, fmt, shape) if len(shape) == 2
                    else [PackedSource(b, fmt, shape[1:]) for b in blocks])
            else:
                try:
                    values = gguf.quants.dequantize(t.data, t.tensor_type)
                except NotImplementedError as e:
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name!r}: quantization type "
                        f"{t.tensor_type.name} is not supported ({e})"
                    ) from e
                w = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
            if self.arch in PERMUTED_ARCHS and hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c["num_attention_heads"] if "q_proj" in hf else c["num_key_value_heads"]
                if isinstance(w, PackedSource):  # whole rows move: the blocks move with them
                    w = PackedSource(unpermute_rotary_rows(w.blocks, heads), w.format, w.shape)
                else:
                    w = unpermute_rotary_rows(w, heads)
            if len(shape) == 3:  # stacked experts: one tensor each, as Hugging Face names them
                prefix, proj = hf.rsplit(".", 2)[0], hf.rsplit(".", 2)[1]
                for e in range(shape[0]):
                    yield f"{prefix}.{e}.{proj}.weight", w[e]
                continue
            yield hf, w


def unpermute_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, heads)`: per head, rows (0, half, 1, half+1, ...) back to (0, 1,
    ..., )."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensor_names(arch: str, blocks: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, from the `gguf` package's own mapping tables."""
    import gguf

    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(arch_id, blocks)
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(blocks):
        hf_names += [f"model.layers.{i}.{m}" for m in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate",
            "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")]
    out = {}
    for hf in hf_names:
        name = table.get_name(hf)
        if name is not None:
            out |= {f"{name}.weight": f"{hf}.weight", f"{name}.bias": f"{hf}.bias"}
    return out
