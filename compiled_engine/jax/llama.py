"""A reference forward of the Llama family (Llama, Qwen2, Qwen3, Mistral) in JAX: a second oracle,
written from the architecture, not from the engine's model code, that loads the same Hugging Face
checkpoints.

Plain full-sequence causal attention (no KV cache), jitted per bucket of sequence lengths (powers of
two, from 16): a greedy step re-runs the whole sequence padded to its bucket, which compiles a
handful of shapes. Everything is computed in `dtype` (float32 by default: bf16 weights upcast
exactly).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class JaxConfig:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    sliding_window: int | None
    tied: bool

    @classmethod
    def from_file(cls, path: Path) -> JaxConfig:
        c = json.loads(path.read_text())
        arch = (c.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"the JAX reference forward knows {', '.join(ARCHITECTURES)}, not {arch}"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r}: only silu is implemented")
        rope = c.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": c.get("rope_theta", 10000.0),
        }
        scaling = c.get("rope_scaling") or {}
        if (
            rope.get("rope_type", "default") != "default"
            or scaling.get("rope_type", "default") != "default"
        ):
            raise ValueError(
                f"rope scaling {rope or scaling}: only the default rotary embedding is implemented"
            )
        windowed = arch == "MistralForCausalLM" or c.get("use_sliding_window")
        return cls(
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            eps=c["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            sliding_window=c.get("sliding_window") if windowed else None,
            tied=bool(c.get("tie_word_embeddings", False)),
        )


def load_weights(model_dir: Path, dtype) -> dict[str, jax.Array]:
    """Every tensor of the checkpoint's safetensors files, as `dtype` JAX arrays."""
    from safetensors import safe_open

    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                weights[name] = f.get_tensor(name).astype(dtype)
    if not weights:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    return weights


def _rms_norm(x, weight, eps: float):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _linear(w: dict, name: str, x):
    y = x @ w[name + ".weight"].T
    bias = w.get(name + ".bias")
    return y if bias is None else y + bias


def forward(w: dict, c: JaxConfig, ids):
    """Logits [T, vocab] of the token ids [T] (one sequence, causal)."""
    t = ids.shape[0]
    x = w["model.embed_tokens.weight"][ids]
    pos = jnp.arange(t)
    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=x.dtype) / c.head_dim))
    angles = pos[:, None].astype(x.dtype) * inv_freq[None, :]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None, :]
    allowed = pos[None, :] <= pos[:, None]
    if c.sliding_window:
        allowed &= pos[None, :] > pos[:, None] - c.sliding_window
    group = c.heads // c.kv_heads
    for i in range(c.layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], c.eps)
        q = _linear(w, p + "self_attn.q_proj", h).reshape(t, c.heads, c.head_dim)
        k = _linear(w, p + "self_attn.k_proj", h).reshape(t, c.kv_heads, c.head_dim)
        v = _linear(w, p + "self_attn.v_proj", h).reshape(t, c.kv_heads, c.head_dim)
        # Qwen3: RMSNorm of each head before the rotary embedding
        if p + "self_attn.q_norm.weight" in w:
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], c.eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], c.eps)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("thd,shd->hts", q, k) * c.head_dim**-0.5
        probs = jax.nn.softmax(jnp.where(allowed[None], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("hts,shd->thd", probs, v).reshape(t, c.heads * c.head_dim)
        x = x + _linear(w, p + "self_attn.o_proj", attn)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.eps)
        gate, up = _linear(w, p + "mlp.gate_proj", h), _linear(w, p + "mlp.up_proj", h)
        x = x + _linear(w, p + "mlp.down_proj", jax.nn.silu(gate) * up)
    x = _rms_norm(x, w["model.norm.weight"], c.eps)
    head = w["model.embed_tokens.weight"] if c.tied else w["lm_head.weight"]
    return x @ head.T


def bucket(n: int) -> int:
    """The padded length a sequence of n tokens runs at."""
    return max(16, 1 << (n - 1).bit_length())


class JaxLlama:
    """`JaxLlama(checkpoint_dir).greedy(prompt, new_tokens)`: tokens and each step's log-softmax."""

    def __init__(self, model_dir: str | Path, dtype=jnp.float32) -> None:
        model_dir = Path(model_dir)
        self.config = JaxConfig.from_file(model_dir / "config.json")
        self.weights = load_weights(model_dir, dtype)
        self._forward = jax.jit(functools.partial(forward, c=self.config))

    def logits(self, ids: list[int]) -> jax.Array:
        """Logits of the last token of `ids` (the sequence padded to its bucket; padding comes after
        it)."""
        padded = np.zeros(bucket(len(ids)), dtype=np.int32)
        padded[: len(ids)] = ids
        return self._forward(self.weights, ids=jnp.asarray(padded))[len(ids) - 1]

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
        ids, steps = list(prompt), []
        for _ in range(new_tokens):
            logp = jax.nn.log_softmax(self.logits(ids))
            ids.append(int(jnp.argmax(logp)))
            steps.append(np.asarray(logp))
        return ids[len(prompt):], np.stack(steps)
