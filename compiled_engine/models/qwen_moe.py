"""Qwen3-MoE and Qwen2-MoE: the Qwen3 / Qwen2 decoder with mixture-of-experts MLPs on the layers
`layers.moe.sparse_layers` names (dense MLPs on the others), and for Qwen2-MoE a shared expert."""

from transformers import PretrainedConfig

from compiled_engine.layers.moe import sparse_layers
from compiled_engine.models.llama import DecoderOptions
from compiled_engine.models.qwen2 import Qwen2ForCausalLM
from compiled_engine.models.qwen3 import Qwen3ForCausalLM
from compiled_engine.models.registry import register


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        opts = Qwen3ForCausalLM.options(config)
        opts.sparse_layers = sparse_layers(config)
        return opts


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        opts = Qwen2ForCausalLM.options(config)
        opts.sparse_layers = sparse_layers(config)
        opts.shared_expert = bool(getattr(config, "shared_expert_intermediate_size", 0))
        return opts
