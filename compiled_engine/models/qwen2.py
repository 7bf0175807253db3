from transformers import PretrainedConfig

from compiled_engine.models.llama import DecoderOptions, LlamaForCausalLM, layer_type_windows
from compiled_engine.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on q, k and v, and optional per-layer sliding windows."""

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, sliding_windows=layer_type_windows(config))
