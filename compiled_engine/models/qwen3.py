from transformers import PretrainedConfig

from compiled_engine.models.llama import DecoderOptions, LlamaForCausalLM, layer_type_windows
from compiled_engine.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before the rotary embedding."""

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(
            qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_windows=layer_type_windows(config)
        )
