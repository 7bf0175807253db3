"""`bench lora`: many LoRA adapters in one batch against the base model alone, side by side in one
process, and against transformers + PEFT.

Random adapters (PEFT's own files, every module an adapter may target, rank `rank`) on one
checkpoint. Two engines with the same settings: `base` (no LoRA) and `lora` (`enable_lora`,
`max_loras` = the adapter count). Each round, alternating:
  offline   `requests` random prompts of `prompt_len` tokens, `output_len` greedy tokens each, all
            at once: the base engine; the LoRA engine with request i on adapter i % adapters; the
            LoRA engine with no adapter (what rows without an adapter cost)
  decode    one request, the time per output token after the first: base engine, LoRA engine
            with an adapter
The best round of each is kept. transformers + PEFT (the adapters loaded once, `set_adapter` per
request, one request at a time as it serves them) runs the first `peft_requests` requests once.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from compiled_engine.llm import LLM
from compiled_engine.lora.request import LoRARequest
from compiled_engine.lora.weights import TARGET_MODULES
from compiled_engine.sampling_params import SamplingParams


def make_adapters(model_dir: str, folder: Path, count: int, rank: int) -> list[str]:
    """`count` random adapters of `model_dir`, saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES),
                            init_lora_weights=False)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        path = folder / f"adapter-{i}"
        model.save_pretrained(path)
        paths.append(str(path))
        base = model.unload()  # the base model again, without the adapter's layers
    return paths


def _timed(fn: Callable[[], list]) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _tok_s(llm: LLM, prompts: list[list[int]], params: SamplingParams,
           loras: list[LoRARequest | None] | None) -> tuple[float, list]:
    seconds, outs = _timed(lambda: llm.generate(prompts, params, use_tqdm=False,
                                                lora_request=loras))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].token_ids for o in outs]


def _decode_ms(llm: LLM, prompt: list[int], tokens: int, lora: LoRARequest | None) -> float:
    """Milliseconds per output token after the first (prefill excluded)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    first, _ = _timed(lambda: llm.generate([prompt], one, use_tqdm=False, lora_request=lora))
    whole, _ = _timed(lambda: llm.generate([prompt], many, use_tqdm=False, lora_request=lora))
    return 1000 * (whole - first) / (tokens - 1)


def _peft_tok_s(model_dir: str, adapters: list[str], prompts: list[list[int]],
                output_len: int) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="adapter-0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=f"adapter-{i}")
    model.eval()
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            model.set_adapter(f"adapter-{i % len(adapters)}")
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False)
            tokens += out.shape[1] - len(prompt)
    return tokens / (time.perf_counter() - t0)


def run(model_dir: str, adapters: int, rank: int, requests: int, prompt_len: int,
        output_len: int, rounds: int, peft_requests: int, log: Callable[[str], None],
        **settings) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(prompt_len)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        log(f"writing {adapters} rank-{rank} adapters with PEFT")
        paths = make_adapters(model_dir, Path(tmp), adapters, rank)
        loras = [LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(paths)]
        mixed = [loras[i % adapters] for i in range(requests)]
        log("starting the base engine")
        base = LLM(model_dir, **settings)
        log("starting the LoRA engine")
        lora = LLM(model_dir, enable_lora=True, max_loras=adapters, max_lora_rank=rank,
                   **settings)
        # reads every adapter (a request of each)
        lora.generate(prompts[:adapters], SamplingParams(max_tokens=1), use_tqdm=False,
                      lora_request=loras)
        best: dict[str, float] = {}

        def keep(name: str, value: float, lower: bool = False) -> None:
            old = best.get(name)
            best[name] = value if old is None or (value < old if lower else value > old) else old

        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            keep("base_tok_s", _tok_s(base, prompts, params, None)[0])
            keep("mixed_tok_s", _tok_s(lora, prompts, params, mixed)[0])
            keep("lora_engine_no_adapter_tok_s", _tok_s(lora, prompts, params, None)[0])
            keep("base_decode_ms", _decode_ms(base, prompts[0], output_len, None), lower=True)
            keep("adapter_decode_ms", _decode_ms(lora, prompts[0], output_len, loras[0]),
                 lower=True)
        base.engine.shutdown()
        lora.engine.shutdown()
        log(f"transformers + PEFT, {peft_requests} requests one at a time")
        peft = _peft_tok_s(model_dir, paths, prompts[:peft_requests], output_len)
    return best | {
        "peft_tok_s": peft,
        "mixed_vs_base": best["mixed_tok_s"] / best["base_tok_s"],
        "no_adapter_vs_base": best["lora_engine_no_adapter_tok_s"] / best["base_tok_s"],
        "mixed_vs_peft": best["mixed_tok_s"] / peft,
        "adapter_decode_vs_base": best["adapter_decode_ms"] / best["base_decode_ms"],
    }
