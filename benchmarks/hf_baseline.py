"""The transformers baseline: its best `generate` variant measured on this machine (plain eager
generate; its static-cache + compile path was slower). Requests are sorted by output length and run
in groups, left-padded, greedy, every row generating the group's longest output (`min_new_tokens` =
`max_new_tokens`). Only the requested output tokens are counted, so the token counts match our
engine's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.datasets import BenchRequest, Session, all_requests
from benchmarks.metrics import RequestTiming
from compiled_engine.models.gguf_checkpoint import is_gguf, open_gguf

PAD_ID = 0


def load_hf_model(model_path: str, dtype: str = "auto", device: str = "auto") -> torch.nn.Module:
    """transformers' model of a checkpoint directory, or of a GGUF file (`auto`: the dtype our
    engine picks), on `device` (`auto`: cuda when available, as our engine)."""
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if is_gguf(model_path):
        where = Path(model_path)
        dtype = open_gguf(where).config_dict["torch_dtype"] if dtype == "auto" else dtype
        model = AutoModelForCausalLM.from_pretrained(
            str(where.parent), gguf_file=where.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def _generate(model: torch.nn.Module, group: list[BenchRequest]) -> list[list[int]]:
    """Each request's first `output_len` generated tokens."""
    width = max(len(r.prompt_ids) for r in group)
    ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for i, r in enumerate(group):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    new = max(r.output_len for r in group)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=PAD_ID)
    return [row[width:width + r.output_len] for row, r in zip(out.tolist(), group, strict=True)]


def run_hf(
    model: torch.nn.Module, sessions: list[Session], group_size: int | None = None
) -> tuple[list[RequestTiming], float, dict[int, list[int]]]:
    """Timings (latency only: `generate` does not stream), the total duration, and each request's
    tokens (by index in `all_requests(sessions)`). Groups of 16 rows on the CPU, 64 on a GPU (wider
    batches feed it better; the padding a group wastes grows with its width)."""
    if group_size is None:
        group_size = 64 if model.device.type == "cuda" else 16
    ordered = all_requests(sessions)
    order = sorted(
        range(len(ordered)), key=lambda i: (ordered[i].output_len, len(ordered[i].prompt_ids))
    )
    reqs = [ordered[i] for i in order]
    timings = []
    outputs: dict[int, list[int]] = {}
    with torch.inference_mode():
        _generate(model, [BenchRequest([5, 6, 7, 8], 2)])  # warm-up
        start = time.perf_counter()
        for i in range(0, len(reqs), group_size):
            group = reqs[i:i + group_size]
            outputs.update(zip(order[i:i + group_size], _generate(model, group), strict=True))
            done = time.perf_counter() - start
            timings.extend(
                RequestTiming(len(r.prompt_ids), r.output_len, latency=done, success=True)
                for r in group
            )
    return timings, time.perf_counter() - start, outputs
