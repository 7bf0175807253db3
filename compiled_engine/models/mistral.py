from transformers import PretrainedConfig

from compiled_engine.models.llama import DecoderOptions, LlamaForCausalLM
from compiled_engine.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer when `sliding_window` is set."""

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        window = getattr(config, "sliding_window", None) or 0
        return DecoderOptions(sliding_windows=[window] * config.num_hidden_layers)
