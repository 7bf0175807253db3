"""The correctness oracle of the parity tests: transformers in fp32 on the same checkpoint (bf16 weights
upcast exactly), greedy, with the log-probabilities of every step; and how an engine's greedy outputs agree
with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from compiled_engine.llm import CompletionOutput


@dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] fp32 log-softmax of each step's logits


def hf_model(path: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """transformers' model of a checkpoint directory or a GGUF file (which it dequantizes to fp32 first)."""
    from transformers import AutoModelForCausalLM

    where = Path(path)
    if where.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(where.parent), gguf_file=where.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def hf_fp32_greedy(path: str, prompts: list[list[int]], new_tokens: int, device: str = "cpu") -> list[Reference]:
    """Plain argmax steps over transformers' KV cache: no EOS handling (`generate`'s min_new_tokens would
    mask EOS, while the engine's ignore_eos still picks it when it is the argmax). Log-probs come back on
    the CPU."""
    hf = hf_model(path, torch.float32, device)
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf(torch.tensor([prompt], device=device), use_cache=True)
            tokens, logprobs = [], []
            for _ in range(new_tokens):
                lp = torch.log_softmax(out.logits[0, -1].float(), -1).cpu()
                tokens.append(int(lp.argmax()))
                logprobs.append(lp)
                out = hf(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                         use_cache=True)
            refs.append(Reference(tokens, torch.stack(logprobs)))
    return refs


def hf_bf16_error(path: str, prompts: list[list[int]], refs: list[Reference], top: int, device: str = "cpu") -> float:
    """How far transformers' own bf16 run is from its fp32 run: the largest |log-prob difference| over fp32's
    `top` most likely tokens at every step, teacher-forced on fp32's tokens."""
    hf = hf_model(path, torch.bfloat16, device)
    worst = 0.0
    with torch.inference_mode():
        for prompt, ref in zip(prompts, refs, strict=True):
            ids = torch.tensor([prompt + ref.tokens[:-1]], device=device)
            lp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:].float(), -1).cpu()
            ids_top = ref.logprobs.topk(top, -1).indices
            worst = max(worst, (lp.gather(1, ids_top) - ref.logprobs.gather(1, ids_top)).abs().max().item())
    return worst


@dataclass
class Agreement:
    """`max_error`: the largest |engine - fp32| log-probability over the top tokens of every step up to the
    first divergence; `divergences`: (prompt, step, fp32 log-prob of its token minus of ours) at each first
    divergence."""

    max_error: float = 0.0
    max_chosen_error: float = 0.0  # the same, over the greedy (chosen) tokens only
    steps: int = 0
    divergences: list[tuple[int, int, float]] = field(default_factory=list)

    def report(self, what: str) -> str:
        gaps = ", ".join(f"prompt {p} step {s}: fp32 gap {g:.4f}" for p, s, g in self.divergences) or "none"
        return (f"{what}: max |logprob error| {self.max_error:.2e} ({self.max_chosen_error:.2e} on the chosen "
                f"tokens) over {self.steps} steps; divergences: {gaps}")


def compare(outputs: list[CompletionOutput], refs: list[Reference]) -> Agreement:
    """Walk each prompt's steps while its tokens equal fp32's; at a divergence record fp32's gap between its
    token and ours, and stop that prompt (what follows continues different text)."""
    agreement = Agreement()
    for p, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        assert out.top_logprobs is not None and len(out.token_ids) == len(ref.tokens)
        for step, (ours, theirs) in enumerate(zip(out.token_ids, ref.tokens, strict=True)):
            lp = ref.logprobs[step]
            if ours != theirs:
                agreement.divergences.append((p, step, (lp[theirs] - lp[ours]).item()))
                break
            agreement.steps += 1
            agreement.max_chosen_error = max(agreement.max_chosen_error, abs(out.logprobs[step] - lp[ours].item()))
            pairs = [(ours, out.logprobs[step]), *out.top_logprobs[step]]
            for token, value in pairs:
                agreement.max_error = max(agreement.max_error, abs(value - lp[token].item()))
    return agreement
