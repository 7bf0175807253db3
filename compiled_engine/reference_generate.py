"""Greedy generation with Hugging Face transformers: the correctness oracle every engine path is held to."""

from __future__ import annotations


def generate_text(model_dir: str, prompt: str, max_tokens: int = 32, chat: bool = True) -> str:
    """Greedy-decode `prompt` with transformers; `chat` applies the checkpoint's chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
