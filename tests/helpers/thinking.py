"""A reasoning model for the tests: a tiny random Qwen3 checkpoint with the demo tokenizer plus
`<think>` and `</think>` (single tokens that decoding keeps, as Qwen3's are) and a chat template of
Qwen3's thinking family: the generation prompt opens the span (`<think>\\n`), or with
`enable_thinking: false` holds an empty one (`<think>\\n\\n</think>\\n\\n`), as Qwen3's own template
does."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from compiled_engine.models.demo import demo_model_dir
from tests.helpers.checkpoints import make_checkpoint

QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")


def make_thinking_checkpoint(path: str) -> str:
    """The checkpoint at `path` (its vocabulary: the demo tokenizer's and the two tags)."""
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = QWEN3_THINKING_TEMPLATE
    make_checkpoint(path, "Qwen3ForCausalLM", vocab_size=len(tokenizer),
                    eos_token_id=tokenizer.eos_token_id, max_position_embeddings=1024)
    tokenizer.save_pretrained(path)
    Path(path, "chat_template.jinja").write_text(QWEN3_THINKING_TEMPLATE)
    return path
