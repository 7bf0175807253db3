"""Runs one planned step: tensors in, sampled tokens out (written to the device token table too)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from compiled_engine.runner.compiled_forward import CompiledForward
from compiled_engine.runner.kv_cache import kv_caches
from compiled_engine.runner.prompt_outputs import (
    KeptRows,
    PromptLogprobRows,
    hidden_rows,
    logprob_targets,
    prompt_logprobs,
)
from compiled_engine.runner.sampler import SampleOutput, Sampler, SamplingRow
from compiled_engine.runner.staging import DeviceEvent, Staging, event_factory
from compiled_engine.runner.step_inputs import (
    DeviceTables,
    StepInputs,
    build_step_inputs,
    sample_targets,
    uses_lora,
)
from compiled_engine.scheduler.plan import StepOutput, StepPlan


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
    compile_mode: str = "default"  # inductor options on the CPU (`compiled_forward.COMPILE_MODES`)


class PendingStep:
    """A launched step whose tokens are on their way to the host: `result()` waits for them (the one
    host sync of a step). On CUDA the outputs are copied into pinned host memory behind an event."""

    def __init__(
        self,
        out: SampleOutput | None,
        make_event: Callable[[], DeviceEvent],
        prompt: PromptLogprobRows | None = None,
        hidden: list[torch.Tensor] | None = None,
    ) -> None:
        self._host: dict[str, torch.Tensor] = {}
        self._event: DeviceEvent | None = None
        self._errors = None if out is None else out.errors
        self._has_tokens, self._has_prompt = out is not None, prompt is not None
        outputs = {} if out is None else {
            name: getattr(out, name) for name in ("tokens", "logprobs", "top_ids", "top_logprobs")
        }
        if prompt is not None:
            outputs |= {f"prompt_{name}": getattr(prompt, name)
                        for name in ("logprobs", "ranks", "top_ids", "top_logprobs")}
        outputs |= {f"hidden_{i}": h for i, h in enumerate(hidden or [])}
        self._num_hidden = len(hidden or [])
        for name, value in outputs.items():
            if value is not None:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._host[name] = host.copy_(value, non_blocking=value.is_cuda)
        if self._host:
            self._event = make_event()
            self._event.record()

    def result(self) -> StepOutput:
        if self._event is None:
            return StepOutput(tokens=[])
        self._event.synchronize()
        h = self._host
        output = StepOutput(
            tokens=h["tokens"].tolist() if self._has_tokens else [], errors=self._errors
        )
        if "logprobs" in h:
            output.logprobs = h["logprobs"].tolist()
        if "top_ids" in h:
            output.top_logprobs = _pairs(h["top_ids"], h["top_logprobs"])
        if self._has_prompt:
            n = len(h["prompt_logprobs"])
            top = (_pairs(h["prompt_top_ids"], h["prompt_top_logprobs"])
                   if "prompt_top_ids" in h else [[] for _ in range(n)])
            output.prompt_logprobs = list(
                zip(h["prompt_logprobs"].tolist(), h["prompt_ranks"].tolist(), top, strict=True)
            )
        if self._num_hidden:
            output.hidden = [h[f"hidden_{i}"] for i in range(self._num_hidden)]
        return output


def _pairs(ids: torch.Tensor, logprobs: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Rows of (token id, log-prob) pairs."""
    return [list(zip(i, lp)) for i, lp in zip(ids.tolist(), logprobs.tolist())]


class ModelRunner:
    """Owns the model, its paged KV cache, the device tables, the compiled graphs and the
    sampler."""

    def __init__(self, model: torch.nn.Module, config: RunnerConfig, device: torch.device) -> None:
        self.model, self.config, self.device = model, config, device
        num_slots = config.num_pages * config.page_size
        shape = (num_slots, model.num_kv_heads, model.head_dim)
        self.k_caches, self.v_caches = kv_caches(model.num_layers, shape, model.dtype, device)
        model.attach_kv_cache(self.k_caches, self.v_caches)
        self.tables = DeviceTables(config.max_rows, config.max_context, device)
        # the readback's (tests fake it)
        self.make_event: Callable[[], DeviceEvent] = event_factory(device)
        self.staging = Staging(device, make_event=self.make_event)
        self.sampler = Sampler(device, seed=config.seed)
        self.forward = CompiledForward(
            model,
            config.buckets,
            enabled=not config.enforce_eager,
            device=device,
            compile_mode=config.compile_mode,
            deterministic=config.deterministic,
        )
        # Launches return before the device has run them (CUDA queues the work): the engine then
        # launches the next step before it reads this one's tokens, on its own thread. On the CPU a
        # launch computes.
        self.asynchronous = device.type == "cuda"

    def launch(
        self, plan: StepPlan, sampling: list[SamplingRow], kept: Sequence[KeptRows] = ()
    ) -> PendingStep:
        """The one entry of a step: apply the plan's writes, run the forward, sample (`sampling`:
        one row per sampling request, in plan order), and write the sampled tokens to the token
        table, all queued on the device without a host sync; the tokens come back through the
        returned `PendingStep`, with what `kept` asks of prompt positions (prompt log-probs, hidden
        states)."""
        # Inputs are built in inference mode too: graphs guard on it, so warm-up and serving must
        # agree.
        with torch.inference_mode():
            targets = self.tables.apply_writes(
                plan, self.staging, sample_targets(plan, self.tables)
            )
            inputs, (logits, hidden) = self._forward(plan, kept)
            n = inputs.num_sampled
            prompt = None
            if inputs.num_prompt:
                prompt = prompt_logprobs(
                    logits[n : n + inputs.num_prompt],
                    self.tables.tokens.view(-1),
                    logprob_targets(kept, plan.reqs, self.tables.flat),
                    max(k.top for k in kept),
                )
            states = hidden_rows(hidden, kept, inputs.token_starts) if kept else None
            if not sampling:
                return PendingStep(None, self.make_event, prompt, states)
            for row in sampling:
                if row.history is not None:
                    row.prompt_ids, row.output_ids = self.tables.history(*row.history)
            out = self.sampler(logits[:n], sampling)
            self.tables.tokens.view(-1).index_copy_(0, targets, out.tokens)
            return PendingStep(out, self.make_event, prompt, states)

    def execute(
        self, plan: StepPlan, sampling: list[SamplingRow], kept: Sequence[KeptRows] = ()
    ) -> StepOutput:
        """`launch`, then wait for the tokens."""
        return self.launch(plan, sampling, kept).result()

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """The logits of the plan's sampling requests (the forward only: no writes, no
        sampling)."""
        inputs, (logits, _) = self._forward(plan, ())
        return logits[: inputs.num_sampled]

    def _forward(
        self, plan: StepPlan, kept: Sequence[KeptRows]
    ) -> tuple[StepInputs, tuple[torch.Tensor, torch.Tensor]]:
        """The step's inputs and its forward's outputs (logits, hidden states). A decode step runs
        its bucket's graph, its inputs built into that graph's buffers where it has them."""
        graph = self.forward.graph_for(len(plan.reqs), uses_lora(plan)) if plan.is_decode else None
        inputs = build_step_inputs(
            plan, self.tables, graph and graph.n_rows, self.staging, graph and graph.inputs, kept
        )
        return inputs, self.forward(inputs, graph)

