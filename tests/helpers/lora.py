"""LoRA adapters for the tests, written by PEFT itself: random weights on a checkpoint, the oracle
(transformers + PEFT in fp32: greedy tokens, log-probs) and the bf16 bound of transformers + PEFT's
own bf16 forward."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.helpers.oracle import (
    TOP,
    Bounds,
    Reference,
    module_bf16_spread,
    module_fp32_greedy,
)

# targets, rank, rsLoRA of the test adapters: every module an adapter may target among them
ADAPTERS = {
    "a": (["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], 8, False),
    "b": (["k_proj", "up_proj"], 4, True),
    "c": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, False),
}


def base_model(path: str) -> torch.nn.Module:
    """transformers' fp32 model of a checkpoint folder or GGUF file (a copy of the one loaded
    first: PEFT wraps the model it is given)."""
    return copy.deepcopy(_loaded(path))


@functools.lru_cache(maxsize=1)
def _loaded(path: str) -> torch.nn.Module:
    where = Path(path)
    if where.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(where.parent), gguf_file=where.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base: str, out: str, targets: list[str], rank: int, rslora: bool = False,
                 seed: int = 0, std: float = 0.2) -> str:
    """A random LoRA adapter of checkpoint `base`, saved by PEFT to folder `out`."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False)
    model = get_peft_model(base_model(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(out)
    return out


def peft_model(base: str, adapter: str) -> torch.nn.Module:
    return PeftModel.from_pretrained(base_model(base), adapter).eval()


@torch.inference_mode()
def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]],
                new_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT with `adapter`) fp32 greedy tokens: plain argmax steps."""
    model = base_model(base) if adapter is None else peft_model(base, adapter)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, do_sample=False)
        out.append(gen[0, len(prompt):].tolist())
    return out


def peft_fp32_greedy(base: str, adapter: str, prompts: list[list[int]],
                     new_tokens: int) -> list[Reference]:
    """The oracle with an adapter: transformers + PEFT fp32, greedy, with every step's log-probs."""
    return module_fp32_greedy(peft_model(base, adapter), prompts, new_tokens)


def peft_bf16_bounds(base: str, adapter: str, prompts: list[list[int]],
                     refs: list[Reference]) -> Bounds:
    """How far a bf16 run of `base` + `adapter` may be from fp32: as far as transformers + PEFT's
    own bf16 forward (the adapter unmerged: its shrink and expand rounded as ours are) and the
    emulated bf16 runs are."""
    spread = module_bf16_spread(lambda: peft_model(base, adapter), prompts, refs, TOP)
    print(f"transformers + PEFT bf16 vs fp32: {spread}")
    return Bounds.bf16(spread)
