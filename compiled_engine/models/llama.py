"""Llama, and the decoder that Qwen2, Qwen3 and Mistral reuse with a few `DecoderOptions`."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from compiled_engine.layers.activation import SiluAndMul
from compiled_engine.layers.attention import Attention, AttentionMetadata
from compiled_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from compiled_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from compiled_engine.layers.moe import SparseMoeBlock
from compiled_engine.layers.norm import RMSNorm
from compiled_engine.layers.rotary import RotaryEmbedding
from compiled_engine.models.registry import register


@dataclass
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: list[int] | None = None  # per layer; 0 = full attention
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts
    shared_expert: bool = False  # Qwen2-MoE: a sigmoid-gated dense expert beside the routed ones


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        opts: DecoderOptions,
        rotary: RotaryEmbedding,
        sliding_window: int,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            opts.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, opts.o_bias
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if opts.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window
        )

    def qkv(
        self, positions: torch.Tensor, x: torch.Tensor, lora: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden states [T, hidden] -> q [T, H, D] and k [T, Hkv, D] with the rotary
        applied, and the whole projection [T, q + 2 kv], whose last columns are v (`value`).

        v is taken from the projection outside the compile region: returned from it as a view of
        the projection at an offset (inductor drops a clone), the caller's graph takes that view for
        a buffer of the projection's size at offset 0 and may reuse it for a larger temporary, which
        then runs past the end of the allocation (seen: heap corruption)."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        projection = self.qkv_proj(x, lora)
        q, k, _ = projection.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, projection

    def value(self, projection: torch.Tensor) -> torch.Tensor:
        """v [T, Hkv, D] from `qkv`'s projection: a view with the projection's token stride (the
        KV store takes any token stride), so that no layer adds a kernel of its own."""
        kv_size = self.qkv_proj.kv_size
        return projection[:, -kv_size:].view(-1, self.num_kv_heads, self.head_dim)


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, intermediate_size: int | None = None
                 ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        """`lora`: each token's adapter slot (`AttentionMetadata.lora_slots`)."""
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        opts: DecoderOptions,
        rotary: RotaryEmbedding,
        sliding_window: int,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, opts, rotary, sliding_window)
        if not sparse:
            self.mlp = DecoderMLP(config, opts.mlp_bias)
        else:
            shared = (DecoderMLP(config, opts.mlp_bias, config.shared_expert_intermediate_size)
                      if opts.shared_expert else None)
            self.mlp = SparseMoeBlock(config, shared)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, opts: DecoderOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, config.rope_parameters
        )
        windows = opts.sliding_windows or [0] * config.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, opts, self.rotary, windows[i], i in opts.sparse_layers)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Each layer is two compile regions around its attention op; the norm that ends a layer's
        region is the next layer's input norm (the last one: the final norm). LoRA adapters' deltas
        (`meta.lora_slots`) are added inside the regions' linears."""
        lora = meta.lora_slots
        residual = self.embed_tokens(input_ids)
        x = self.layers[0].input_layernorm(residual)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            q, k, projection = attention_inputs(layer.self_attn, positions, x, lora)
            out = layer.self_attn.attn(q, k, layer.self_attn.value(projection), meta)
            region = moe_layer_outputs if isinstance(layer.mlp, SparseMoeBlock) else layer_outputs
            x, residual = region(layer, out, residual, next_norm, lora)
        return x


# Regional compilation: dynamo traces each of these once per graph as a subgraph, inductor compiles
# it once and every layer calls the same code, so compile time does not grow with depth. The
# attention op between them stays outside: it writes the KV cache, and a compile region may not
# mutate its inputs.
@torch.compiler.nested_compile_region
def attention_inputs(attn: DecoderAttention, positions: torch.Tensor, x: torch.Tensor,
                     lora: torch.Tensor | None):
    return attn.qkv(positions, x, lora)


def _layer_outputs(
    layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm,
    lora: torch.Tensor | None,
):
    """Attention output [T, H, D] -> (the next layer's normed input, the residual stream). A
    mixture of experts takes no adapter."""
    attn = layer.self_attn
    x, residual = layer.post_attention_layernorm(
        attn.o_proj(attn_out.reshape(-1, attn.num_heads * attn.head_dim), lora), residual
    )
    mlp = layer.mlp(x) if isinstance(layer.mlp, SparseMoeBlock) else layer.mlp(x, lora)
    return next_norm(mlp, residual)


# One region per layer structure: torch reuses a region's compiled code for every call of the same
# function, and a dense layer's code run with a mixture-of-experts layer's weights reads and writes
# out of bounds (seen: heap corruption in a model with both kinds of layers). Two functions, two
# regions.
@torch.compiler.nested_compile_region
def layer_outputs(layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor,
                  next_norm: RMSNorm, lora: torch.Tensor | None):
    return _layer_outputs(layer, attn_out, residual, next_norm, lora)


@torch.compiler.nested_compile_region
def moe_layer_outputs(layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor,
                      next_norm: RMSNorm, lora: torch.Tensor | None):
    return _layer_outputs(layer, attn_out, residual, next_norm, lora)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type_windows(config: PretrainedConfig) -> list[int]:
    """Per-layer sliding windows from `layer_types` (Qwen2/Qwen3 style)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    return [window if t == "sliding_attention" else 0 for t in types]


@register("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (our fused module name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=getattr(config, "mlp_bias", False)
        )

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = DecoderModel(config, self.options(config))
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if tied else None
        )
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size  # the length of its embeddings
        self.num_kv_heads = attn.num_kv_heads  # per rank
        self.head_dim = attn.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.compute_dtype

    def attach_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """One [num_slots, num_kv_heads, head_dim] K and V tensor per layer."""
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(
                f"expected {self.num_layers} K and V caches, got {len(k_caches)} and "
                f"{len(v_caches)}"
            )
        for layer, k, v in zip(self.model.layers, k_caches, v_caches, strict=True):
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = k, v

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def lora_linears(self) -> dict[str, nn.Module]:
        """The linears a LoRA adapter may target, by module path (not a mixture of experts')."""
        out: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}"
            out[f"{prefix}.self_attn.qkv_proj"] = layer.self_attn.qkv_proj
            out[f"{prefix}.self_attn.o_proj"] = layer.self_attn.o_proj
            if isinstance(layer.mlp, DecoderMLP):
                out[f"{prefix}.mlp.gate_up_proj"] = layer.mlp.gate_up_proj
                out[f"{prefix}.mlp.down_proj"] = layer.mlp.down_proj
        return out

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocabulary slice of the logits (what the compiled graphs return)."""
        return self.lm_head.local_logits(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return self.lm_head.gather_logits(local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
