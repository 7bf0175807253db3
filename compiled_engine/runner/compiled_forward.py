"""The model forward as compiled graphs. On the CPU: one static-shape graph per decode bucket, one
dynamic-token-count graph for prefill / mixed steps, and one dynamic-batch decode graph for decode
batches larger than the largest bucket. On CUDA the dynamic-batch decode graph is compiled once and
a CUDA graph of it is captured per bucket (at least 2 rows: a 1-row batch runs padded to 2), so
buckets cost captures, not compiles. Inside each graph every decoder layer calls the same two
compiled regions (`models.llama`), so compiling costs about one layer, not the model's depth; the
attention ops between them are opaque custom ops.
During the warm-up each graph is loaded precompiled from the compile cache, or compiled ahead of
time and saved there (`runner.precompiled`); without a cache folder, or if that fails, torch.compile
compiles lazily."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from compiled_engine.config import COMPILE_MODE_NAMES
from compiled_engine.layers.attention import AttentionMetadata
from compiled_engine.layers.invariance import set_batch_invariant
from compiled_engine.runner import attention_metadata, precompiled
from compiled_engine.runner.buckets import next_bucket
from compiled_engine.runner.step_inputs import StepInputs


def _configure_dynamo() -> None:
    """Dynamo's process-wide settings that the engine's graphs need (set by the first
    CompiledForward)."""
    # One graph per decode bucket plus the extend graph must fit in dynamo's per-function cache.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 512
    )
    # With dynamic=True dynamo traces float module attributes (RMSNorm eps, attention scale) as
    # symbolic floats, then restarts the trace to specialize them: that first attempt missed the AOT
    # autograd cache on every start, and aot_compile has no restart at all (it raises
    # TensorifyScalarRestartAnalysis).
    torch._dynamo.config.specialize_float = True


# `EngineConfig.compile_mode` -> inductor options, applied on the CPU only (a GPU always compiles in
# the default mode, then captures CUDA graphs). Compared with `python -m
# benchmarks.decode_step` (docs/benchmarks.md):
#   default    generated C++ for the pointwise ops; linears call torch's GEMM (fp32) or
#              `kernels::linear` (bf16: weights prepared once for the CPU's fastest GEMM).
#              Precompiled and cached: warm starts are fast.
#   freezing   weights become graph constants and inductor packs the linears itself (so bf16 linears
#              stay plain matmuls in these graphs, see `kernels.ops.linear`), constant folding.
#              Bypasses the FX graph cache and is never precompiled (every start compiles), each
#              graph holds its own packed copy of the linear weights, and tiny fp32 GEMVs get
#              slower.
#   max-autotune-freezing   freezing + inductor's C++ GEMM templates (AMX), benchmarked at compile
#              time: the fastest bf16 steps on AMX, for a long compile of every graph on every
#              start.
COMPILE_MODES: dict[str, dict[str, bool]] = {
    "default": {},
    "freezing": {"freezing": True},
    "max-autotune-freezing": {"freezing": True, "max_autotune": True},
}
assert tuple(COMPILE_MODES) == COMPILE_MODE_NAMES

# Inductor options of every CPU mode: no shape asserts per buffer. (Inductor's C++ wrapper, which
# calls the kernels without the Python wrapper's per-line cost, cannot call a compile region:
# `invoke_subgraph` has no C++ wrapper codegen. The regions are worth far more: docs/benchmarks.md,
# "Cold start".)
CPU_OPTIONS: dict[str, bool] = {"size_asserts": False}


@dataclass(frozen=True, slots=True)
class DecodeGraph:
    """The graph a decode batch runs: the `n_rows` it is padded to, the key of its compiled graph
    (its bucket, or "decode": the dynamic-batch graph beyond the largest bucket), and on CUDA its
    captured graph, whose input buffers the step's inputs are built into."""

    n_rows: int
    key: int | str
    captured: _CapturedDecode | None = None
    lora: bool = False  # with adapters: the LoRA variant of its graph

    @property
    def inputs(self) -> StepInputs | None:
        return None if self.captured is None else self.captured.inputs


# what every graph returns: the logits at the logits index, every token's final hidden state
_Outputs = tuple[torch.Tensor, torch.Tensor]


class CompiledForward:
    """Picks the graph of each step. `precompiled_dir` (set by the warm-up, under the compile-cache
    lock) makes each graph's first call load it from there, or compile it ahead of time and save it
    there."""

    def __init__(
        self, model: torch.nn.Module, buckets: list[int], enabled: bool, device: torch.device,
        compile_mode: str = "default", deterministic: bool = True,
    ) -> None:
        self.model = model
        self.enabled = enabled
        # every graph is traced, and every eager step runs, batch-invariant
        self.deterministic = deterministic
        set_batch_invariant(model, deterministic)
        self.device = device
        if enabled and device.type == "cuda":
            # captured from the dynamic graph, whose batch is >= 2
            buckets = [max(b, 2) for b in buckets]
        self.buckets = sorted(set(buckets)) if enabled else []
        self.cuda_graphs: dict[int, _CapturedDecode] = {}
        self.precompiled_dir: Path | None = None
        if enabled:
            _configure_dynamo()
        self._set_compile_mode(compile_mode)

    def _set_compile_mode(self, mode: str) -> None:
        """The inductor options (see COMPILE_MODES) every graph is compiled with."""
        if mode not in COMPILE_MODES:
            raise ValueError(
                f"unknown compile_mode {mode!r}; use one of {', '.join(COMPILE_MODES)}"
            )
        self.compile_mode = mode
        self._freezing = False
        # (bucket, "extend" or "decode"; its LoRA variant or not) -> its graph
        self.graphs: dict[object, Callable[..., _Outputs]] = {}
        if not self.enabled:
            return
        self._options = {**CPU_OPTIONS, **COMPILE_MODES[mode]} if self.device.type == "cpu" else {}
        if self.deterministic:
            # Fused kernels round every intermediate to its dtype as eager does: otherwise whether
            # an add feeding a norm is rounded to bf16 first depends on the fusion, which differs
            # between graphs (bucket sizes).
            self._options["emulate_precision_casts"] = True
        # Dynamo reads `freezing` from the global config when it traces (to install the weights as
        # graph attributes rather than inputs), so the flag is also set around each graph's first
        # call, not only passed here. The KV caches stay graph inputs: store_kv mutates them, and
        # freezing keeps those.
        self._freezing = bool(self._options.get("freezing", False))
        self._decode = self._compiler(_decode_graph, dynamic=False)
        self._dynamic = {
            key: self._marked(self._compiler(fn, dynamic=True))
            for key, fn in DYNAMIC_GRAPHS.items()
        }

    @staticmethod
    def _marked(graph: Callable[..., _Outputs]) -> Callable[..., _Outputs]:
        return lambda *args: graph(*_mark_dynamic(args))

    def _compiler(self, fn: Callable[..., _Outputs], dynamic: bool, fullgraph: bool = False):
        return torch.compile(
            fn, dynamic=dynamic, fullgraph=fullgraph, options=self._options or None
        )

    def graph_for(self, n: int, lora: bool = False) -> DecodeGraph:
        """The graph a decode batch of `n` requests runs: its bucket, else the shape-generic decode
        graph at `n` rows, at least 2 there (dynamo specializes a dimension of size 1, so one row
        would compile a graph of its own). `lora`: a request has an adapter (on CUDA that variant
        runs uncaptured)."""
        bucket = next_bucket(self.buckets, n)
        if bucket is not None and not (lora and self.device.type == "cuda"):
            return DecodeGraph(bucket, bucket, None if lora else self.cuda_graphs.get(bucket), lora)
        # (CUDA: a step with adapters runs the dynamic-batch graph, uncaptured)
        return DecodeGraph(max(n, 2) if self.enabled else n, "decode", lora=lora)

    def __call__(
        self, inputs: StepInputs, graph: DecodeGraph | None = None
    ) -> _Outputs:
        """The step's logits over the whole vocabulary (at `inputs.logits_index`) and the final
        hidden state of every token; `graph`: a decode step's (`graph_for`), None for a prefill or
        mixed step. The graphs return each TP rank's slice; the vocab all-gather
        runs outside them: its functional collective takes the process group as an `Any` argument,
        which inductor's C++ wrapper cannot pass (compiling a TP graph raised `arg type Any is not
        yet supported by custom_op_wrapper`)."""
        local, hidden = self._local_logits(inputs, graph)
        return self.model.gather_logits(local), hidden

    def _local_logits(
        self, inputs: StepInputs, graph: DecodeGraph | None
    ) -> _Outputs:
        if not self.enabled:
            return _logits(self.model, *_args(inputs))
        lora = inputs.meta.lora_slots is not None
        if graph is None:
            return self._run("extend", _args(inputs), lora)
        if graph.captured is not None:  # the inputs were built into its buffers
            return graph.captured.replay()
        return self._run(graph.key, _args(inputs), lora)

    def _run(self, base: object, args: tuple, lora: bool = False) -> _Outputs:
        """Run graph `base` (a bucket, "extend" or "decode"), or its LoRA variant: the same compiled
        function, traced again for the adapters' inputs (a graph of its own, and a file of its own
        when precompiled)."""
        key = (base, lora)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph(self.model, *args)
        # Freezing is on for the first call of each graph only (the one that traces and compiles
        # it): patching the config costs tens of microseconds, too much for every step.
        with inductor_config.patch(freezing=True) if self._freezing else contextlib.nullcontext():
            graph = self._first_graph(key, (self.model, *args))
            out = graph(self.model, *args)
        self.graphs[key] = graph
        return out

    def _first_graph(self, key: tuple[object, bool], args: tuple) -> Callable[..., _Outputs]:
        """The precompiled graph when there is a folder for it (freezing makes the weights graph
        constants: never saved), else the lazily compiled one."""
        base, lora = key
        lazy = self._dynamic.get(base, self._decode)
        if self.precompiled_dir is None or self._freezing:
            return lazy
        name = {"extend": "extend", "decode": "decode-dynamic"}.get(base, f"decode-{base}")
        name += "-lora" if lora else ""
        path, static = self.precompiled_dir / f"{name}.bin", base not in DYNAMIC_GRAPHS
        return (
            precompiled.load_or_compile(
                lambda: self._aot_compile(base, args), lazy, args, path, static
            )
            or lazy
        )

    def _aot_compile(self, key: object, args: tuple):
        if key not in DYNAMIC_GRAPHS:
            return self._compiler(_decode_graph, dynamic=False, fullgraph=True).aot_compile(
                (args, {})
            )
        # Marked dimensions get symbols of their own (unmarked ones would be duck-sized: equal sizes
        # in the example, one symbol). The saved guards lose the markings and reject marked inputs,
        # so later calls pass unmarked tensors (which the guards of a graph compiled in this process
        # accept too).
        graph = self._compiler(DYNAMIC_GRAPHS[key], dynamic=True, fullgraph=True)
        return graph.aot_compile((_mark_dynamic(args), {}))

    def capture_cuda_graphs(self, make_inputs) -> None:
        """Capture every decode bucket, largest first, into one memory pool, each from the one
        dynamic-batch decode graph (CUDA only)."""
        pool = torch.cuda.graph_pool_handle()
        for n_rows in sorted(self.buckets, reverse=True):
            self.cuda_graphs[n_rows] = _CapturedDecode(lambda *args: self._run("decode", args),
                                                       make_inputs(n_rows), pool)


def _logits(
    model: torch.nn.Module, input_ids, positions, meta: AttentionMetadata, logits_index
) -> _Outputs:
    """This rank's logits at `logits_index`, and every token's final hidden state (the forward
    computes them all anyway; embeddings pool them)."""
    hidden = model(input_ids, positions, meta)
    return model.local_logits(hidden.index_select(0, logits_index)), hidden


# Two entry points with their own code objects, so that dynamo keeps their graphs apart. The model
# is an argument (not a closure or `self`), so that a precompiled graph saves no module and runs
# with any model of the same shapes.
def _decode_graph(model: torch.nn.Module, *args) -> _Outputs:
    return _logits(model, *args)


def _extend_graph(model: torch.nn.Module, *args) -> _Outputs:
    return _logits(model, *args)


def _dynamic_decode_graph(model: torch.nn.Module, *args) -> _Outputs:
    return _logits(model, *args)


# Graphs with a dynamic token / row count, by key: prefill and mixed steps, and decode batches
# larger than the largest bucket.
DYNAMIC_GRAPHS = {"extend": _extend_graph, "decode": _dynamic_decode_graph}


def _args(inputs: StepInputs) -> tuple:
    return inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index


class _CapturedDecode:
    """Static input buffers + a CUDA graph of one decode bucket: a step builds its inputs into the
    buffers (`DecodeGraph.inputs`), then replays."""

    def __init__(self, fn, inputs: StepInputs, pool) -> None:
        self.inputs = inputs
        args = _args(inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*args)

    def replay(self) -> _Outputs:
        """Run the graph on the step's inputs, which were built into its buffers
        (`DecodeGraph.inputs`)."""
        self.graph.replay()
        return self.output


def _mark_dynamic(args: tuple) -> tuple:
    """`args` of a dynamic graph, with the token / request / sampled-row dimension of each tensor
    marked."""
    _, input_ids, positions, meta, logits_index = args
    for t in (input_ids, positions, logits_index, *attention_metadata.dynamic_tensors(meta)):
        torch._dynamo.mark_dynamic(t, 0)
    return args
