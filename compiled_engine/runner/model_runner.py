"""Runs one planned step: tensors in, sampled tokens out (written to the device token table too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compiled_engine.runner.compiled_forward import CompiledForward
from compiled_engine.runner.sampler import SampleOutput, Sampler, SamplingRow
from compiled_engine.runner.step_inputs import DeviceTables, StepInputs, build_step_inputs
from compiled_engine.scheduler.plan import Batch


@dataclass
class RunnerConfig:
    max_rows: int
    max_context: int
    page_size: int
    num_pages: int  # including the dummy page 0
    buckets: list[int] = field(default_factory=list)  # decode batch sizes with a compiled graph
    enforce_eager: bool = False
    seed: int = 0
    deterministic: bool = True  # batch-invariant kernels (EngineConfig.deterministic)


@dataclass
class StepOutput:
    tokens: list[int]  # one per sampled request, in plan order
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class ModelRunner:
    """Owns the model, its paged KV cache, the device tables, the compiled graphs and the sampler."""

    def __init__(self, model: torch.nn.Module, config: RunnerConfig, device: torch.device) -> None:
        self.model, self.config, self.device = model, config, device
        num_slots = config.num_pages * config.page_size
        shape = (num_slots, model.num_kv_heads, model.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(model.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(model.num_layers)]
        model.attach_kv_cache(self.k_caches, self.v_caches)
        self.tables = DeviceTables(config.max_rows, config.max_context, device)
        self.sampler = Sampler(device, seed=config.seed)
        self.forward = CompiledForward(model, config.buckets, enabled=not config.enforce_eager, device=device,
                                       deterministic=config.deterministic)

    def execute(self, batch: Batch, rows: Callable[[StepInputs], list[SamplingRow]]) -> StepOutput:
        """Apply the plan's writes, run the forward, sample, and write sampled tokens to the token table.

        `rows` builds the sampler's per-request view (it may read token history from the tables)."""
        # Inputs are built in inference mode too: graphs guard on it, so warm-up and serving must agree.
        with torch.inference_mode():
            self.tables.apply_writes(batch)
            pad_to = self.forward.decode_rows(len(batch.reqs)) if batch.is_decode else None
            inputs = build_step_inputs(batch, self.tables, pad_to)
            logits = self.forward(inputs)[: inputs.num_sampled]
            if not inputs.num_sampled:
                return StepOutput(tokens=[])
            out = self.sampler(logits, rows(inputs))
            self.tables.tokens[
                torch.tensor(inputs.sample_rows, device=self.device),
                torch.tensor(inputs.sample_next_pos, device=self.device),
            ] = out.tokens
        return _to_host(out)

    def history(self, row: int, prompt_len: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views of a row's prompt tokens and generated tokens (for penalties)."""
        return self.tables.tokens[row, :prompt_len], self.tables.tokens[row, prompt_len:length]


def _to_host(out: SampleOutput) -> StepOutput:
    result = StepOutput(tokens=out.tokens.tolist())
    if out.logprobs is not None:
        result.logprobs = out.logprobs.tolist()
    if out.top_ids is not None:
        result.top_logprobs = [
            list(zip(ids, lps)) for ids, lps in zip(out.top_ids.tolist(), out.top_logprobs.tolist())
        ]
    return result
