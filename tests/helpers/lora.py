"""LoRA adapters for the tests, written by PEFT itself: random weights on a checkpoint, the oracle
(transformers + PEFT in fp32: greedy tokens, log-probs) and the bf16 bound of transformers + PEFT's
own bf16 forward."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint
from tests.helpers.oracle import (
    TOP,
    Bounds,
    Reference,
    hf_model,
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
    return copy.deepcopy(hf_model(path, torch.float32))


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


def llama_with_adapters(root: Path, **shape: object) -> tuple[str, dict[str, str]]:
    """A random Llama checkpoint (with the demo tokenizer) under `root` and the test adapters of it
    (`ADAPTERS`), by name -> folder."""
    base = add_demo_tokenizer(make_checkpoint(str(root / "base"), "LlamaForCausalLM", **shape))
    paths = {name: make_adapter(base, str(root / name), targets, rank, rslora, seed=i)
             for i, (name, (targets, rank, rslora)) in enumerate(ADAPTERS.items(), 1)}
    return base, paths


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


def gguf_adapter(peft_dir: str, out: str, heads: dict[str, int], arch: str = "llama") -> str:
    """The PEFT adapter in `peft_dir` as llama.cpp's `convert_lora_to_gguf.py` writes it:
    `general.type = adapter`, `adapter.lora.alpha`, `<gguf tensor>.lora_a` / `.lora_b` (fp32), the
    rows of q's and k's B permuted into llama.cpp's rotary layout (`heads`: of q_proj, k_proj)."""
    import json

    import gguf
    from safetensors.torch import load_file

    from compiled_engine.models.gguf_checkpoint import hf_tensor_names

    config = json.loads((Path(peft_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(peft_dir) / "adapter_model.safetensors"))
    blocks = 1 + max(int(k.split("layers.")[1].split(".")[0]) for k in tensors)
    to_gguf = {hf: name for name, hf in hf_tensor_names(arch, blocks).items()}
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key in sorted(tensors):
        module, which = key.removeprefix("base_model.model.").split(".lora_")
        w = tensors[key].float()
        leaf = module.rsplit(".", 1)[-1]
        if which.startswith("B") and leaf in heads:  # llama.cpp's permute of the rows
            n = heads[leaf]
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        suffix = "lora_a" if which.startswith("A") else "lora_b"
        writer.add_tensor(f"{to_gguf[module + '.weight']}.{suffix}", w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
