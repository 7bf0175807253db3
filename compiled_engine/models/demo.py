"""The built-in demo model: a small Llama checkpoint with RANDOM weights, for trying the plumbing.

It is created deterministically on first use in a cache folder, in standard Hugging Face layout
(config.json, generation_config.json, model.safetensors, tokenizer files with a chat template), so
every command that takes `--model` can default to it without a download. The same repo commit gives
byte-identical files on every machine: weights come from per-tensor seeded generators and the
sentencepiece tokenizer ships in the package
(`compiled_engine/models/demo_tokenizer/tokenizer.model`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

DEMO_NAME = "demo"
DEMO_VERSION = "v2"
DEMO_LABEL = (
    "compiled-engine demo model (random weights: output is gibberish, for trying the plumbing)"
)

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# Tools and tool calls in the Hermes format (`<tool_call>{"name", "arguments"}</tool_call>`), as
# Qwen's templates write them: the server's default tool-call parser reads the same.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}"
    "{{ '<|system|>\nTools: answer <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call> to call one.\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{{ '<|assistant|>\n' }}"
    "{% for call in message['tool_calls'] %}{{ '<tool_call>' }}"
    "{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}{{ '</tool_call>' }}{% endfor %}"
    "{{ eos_token + '\n' }}{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
    "add_prefix_space": False,
    "model_max_length": DEMO_CONFIG["max_position_embeddings"],
    "chat_template": CHAT_TEMPLATE,
}

_SPM_FILE = Path(__file__).with_name("demo_tokenizer") / "tokenizer.model"


def cache_root() -> Path:
    """Folder for everything compiled-engine caches (`$COMPILED_ENGINE_CACHE` or
    ~/.cache/compiled-engine)."""
    env = os.environ.get("COMPILED_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "compiled-engine"


def demo_model_dir(root: Path | None = None) -> Path:
    """Path of the demo checkpoint, creating it on first use."""
    return cached_folder((root or cache_root()) / f"demo-model-{DEMO_VERSION}", write_demo_model)


def cached_folder(
    target: Path, write: Callable[[Path], None], marker: str = "model.safetensors"
) -> Path:
    """`target`, written by `write` into a temporary folder and renamed into place on first use (so
    a concurrent or interrupted creation never leaves a half-written folder); `marker` is a file it
    holds."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent process won the race; its copy is identical
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def random_llama_weights(c: dict, dtype: str = "float32") -> dict:
    """Every tensor of a Llama (or Qwen3, or Qwen3-MoE with every layer routed) checkpoint with
    config `c`, each from its own seeded generator (so the bytes do not depend on creation order);
    norms are ones."""
    import torch

    hidden, inter, vocab, head_dim = (
        c["hidden_size"],
        c["intermediate_size"],
        c["vocab_size"],
        c["head_dim"],
    )
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        experts = c.get("num_experts", 0)
        if experts:
            moe = c["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                shapes |= {q + "gate_proj.weight": (moe, hidden),
                           q + "up_proj.weight": (moe, hidden),
                           q + "down_proj.weight": (hidden, moe)}
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        if c.get("model_type") in ("qwen3", "qwen3_moe"):  # per-head RMSNorms of q and k
            shapes |= {
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
            }
    shapes |= {"model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings"):
        shapes |= {"lm_head.weight": (vocab, hidden)}
    out_dtype = getattr(torch, dtype)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=out_dtype)
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
        tensors[name] = (torch.randn(shape, generator=gen) * std).to(out_dtype)
    return tensors


def write_demo_model(out: Path) -> None:
    """Write the whole demo checkpoint into `out` (deterministic bytes)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "config.json", DEMO_CONFIG)
    dump_json(
        out / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": [2], "do_sample": False},
    )
    save_file(
        random_llama_weights(DEMO_CONFIG), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    staging = out / ".tokenizer-src"
    staging.mkdir()
    shutil.copyfile(_SPM_FILE, staging / "tokenizer.model")
    dump_json(staging / "tokenizer_config.json", TOKENIZER_CONFIG)
    AutoTokenizer.from_pretrained(str(staging)).save_pretrained(str(out))
    shutil.rmtree(staging)
    (out / "README.md").write_text(
        f"# {DEMO_LABEL}\n\nCreated by compiled_engine/models/demo.py.\n"
    )


def dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
