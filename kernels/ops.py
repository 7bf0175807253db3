"""The kernel ops (`torch.ops.kernels.*`): the only way the engine reaches a kernel.

Each op has one schema and, per device, one implementation:
    CUDA  the Triton kernels of `kernels.triton` (attention, KV store, deterministic mode's
          linear, the packed linear on blocks of 32); torch for linear and argmax otherwise
    CPU   the native C++ kernels of `kernels.cpu` where they load, registered by the library itself
          (native/torch_ops.cpp); they hand what they decline to `kernels::<op>_portable`
    else  the portable torch implementations of `kernels.portable` (CompositeExplicitAutograd: every
          device without its own kernel, the CPU too when the native library is not there)

Each op is opaque to torch.compile (one node, a fake implementation for shapes). They are defined
with `torch.library.Library` and per-device implementations rather than `torch.library.custom_op`,
whose Python wrapper costs more per call of a mutating op than the CPU decode attention itself
(docs/benchmarks.md). The native library is built and loaded by `kernels.init` (or the first
`load_cpu_kernels` call; never at import), and the Triton module is imported on the first CUDA call,
so that tests can set TRITON_INTERPRET before anything decorates a kernel.
"""

from __future__ import annotations

import functools

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from kernels import expert_load, interleave
from kernels.cpu import build, isa
from kernels.packed import BY_CODE, FORMATS, PackedWeight, dequantize_stack
from kernels.portable import attention as portable_attention
from kernels.portable import dequantize as portable_dequantize
from kernels.portable import linear as portable_linear
from kernels.portable import lora as portable_lora
from kernels.portable import moe as portable_moe

_lib = torch.library.Library("kernels", "DEF")
_SCHEMAS = {
    "store_kv": "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()",
    "decode_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
    "Tensor seq_lens, float scale, int sliding_window=0, float soft_cap=0.0, bool invariant=False) "
    "-> Tensor",
    "extend_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
    "Tensor cu_q_lens, Tensor seq_lens, float scale, int sliding_window=0, float soft_cap=0.0, "
    "bool invariant=False) -> Tensor",
    "linear": "(Tensor x, Tensor weight, Tensor? bias=None, bool invariant=False) -> Tensor",
    "argmax": "(Tensor x) -> Tensor",
    "linear_packed": "(Tensor x, Tensor blocks, int format, int in_features, Tensor? bias=None, "
    "bool invariant=False) -> Tensor",
    "dequantize": "(Tensor blocks, int format, int in_features) -> Tensor",
    "fused_moe": "(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "bool invariant=False, int w13_format=-1, int w2_format=-1) -> Tensor",
    "lora_delta": "(Tensor x, Tensor a, Tensor b, Tensor slots, int[] part_rows) -> Tensor",
}
_PORTABLE = {
    "store_kv": portable_attention.store_kv,
    "decode_attention": portable_attention.decode_attention,
    "extend_attention": portable_attention.extend_attention,
    "linear": portable_linear.linear,
    "argmax": lambda x: torch.argmax(x, dim=-1),
    "linear_packed": portable_dequantize.linear_packed,
    "dequantize": portable_dequantize.dequantize,
    "fused_moe": portable_moe.fused_moe,
    # (B is zero off its projections' blocks: the full product is the same)
    "lora_delta": portable_lora.lora_delta,
}
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema)
    # what the native kernels hand on for inputs they decline
    _lib.define(_name + "_portable" + _schema)
    _lib.impl(_name, _PORTABLE[_name], "CompositeExplicitAutograd")
    _lib.impl(_name + "_portable", _PORTABLE[_name], "CompositeExplicitAutograd")

store_kv = torch.ops.kernels.store_kv.default
"""store_kv(k_cache, v_cache, k, v, slots): write k, v [T, Hkv, D] into the caches [S, Hkv, D] at
`slots` [T] int64; slots < 0 are skipped."""

decode_attention = torch.ops.kernels.decode_attention.default
"""decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window=0,
soft_cap=0.0, invariant=False): one new query per row, q [B, H, D] -> [B, H, D]; page_table [B, W]
holds raw KV slots; rows with seq_len 0 give zeros. `invariant`: as `linear`'s, for each query
row."""

extend_attention = torch.ops.kernels.extend_attention.default
"""extend_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window=0,
soft_cap=0.0, invariant=False): ragged new tokens q [T, H, D] -> [T, H, D]; request b's queries
cu_q_lens[b]:cu_q_lens[b+1] are its last positions and attend causally to the whole row (prefix
included). With `invariant`, a query's output is bit-identical to `decode_attention`'s for the same
query and keys."""

argmax = torch.ops.kernels.argmax.default
"""argmax(x [R, V]) -> [R] int64: `torch.argmax(x, -1)` (the first maximum, or the first NaN)."""

Experts = torch.Tensor | PackedWeight  # a layer's stacked expert weights [E, N, K]


def fused_moe(x: torch.Tensor, w13: Experts, w2: Experts, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """The mixture-of-experts MLP, x [T, H] -> [T, H], with w13 [E, 2I, H] (each expert's gate rows,
    then its up rows), w2 [E, H, I] and each token's k experts and weights [T, k]: tokens sorted by
    expert, one GEMM per projection per expert, the weighted sum back in token order, each token's
    experts added in its slot order (no atomics). Either weight may be packed (a `PackedWeight` of
    experts): its blocks are read as they are.
    `invariant`: as `linear`'s, per token, whatever tokens share its experts. Portable on the CPU
    (`kernels.portable.moe`), Triton's grouped GEMMs on CUDA (`kernels.triton.moe`, no host sync: a
    decode step stays one CUDA graph; always batch-invariant; packed experts dequantized per call
    there); either counts each expert's tokens (`expert_tokens`)."""
    (w13, f13), (w2, f2) = _expert_tensor(w13), _expert_tensor(w2)
    return torch.ops.kernels.fused_moe.default(x, w13, w2, topk_weights, topk_ids, invariant,
                                               f13, f2)


def _expert_tensor(w: Experts) -> tuple[torch.Tensor, int]:
    """What the op takes for a stack of experts: the tensor, and its block format's code (-1:
    dense)."""
    return (w.blocks, w.code) if isinstance(w, PackedWeight) else (w, -1)


def expert_tokens(w13: Experts) -> list[int]:
    """How many tokens each expert of a `fused_moe` layer (its `w13`) has computed in this process:
    the layer's load, expert by expert."""
    return expert_load.tokens(_expert_tensor(w13)[0])


def reset_expert_tokens(w13: Experts) -> None:
    """Count a layer's expert load from zero again (after the warm-up's dummy steps)."""
    expert_load.reset(_expert_tensor(w13)[0])


@torch.compiler.assume_constant_result
def _packed_linears() -> bool:
    """Whether CPU bf16 linears take the op: always, unless a graph is being frozen (inductor's
    freezing packs constant weights itself, and max-autotune then picks its own GEMM templates: an
    opaque op would hide the linears from both). A constant to torch.compile, read while tracing."""
    return not inductor_config.freezing


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None,
           invariant: bool = False) -> torch.Tensor:
    """`F.linear`; CPU bf16 weights go through `kernels::linear` (a copy of the weight prepared once
    for the CPU's fastest GEMM: see native/torch_ops.cpp), everything else straight to torch.
    `invariant` (deterministic mode): every linear takes the op, and each row's result depends on
    that row only, never on the batch, its size, chunking, cached prefixes or the step kind.

    A `PackedWeight` goes to `kernels::linear_packed`: on the CPU with bf16 activations the native
    kernel (activations quantized to int16 per row in blocks of 32; batch-invariant always), else
    the weight dequantized and multiplied in fp32."""
    if isinstance(weight, PackedWeight):
        return torch.ops.kernels.linear_packed.default(
            x, weight.blocks, weight.code, weight.in_features, bias, invariant
        )
    if invariant:
        return torch.ops.kernels.linear.default(x, weight, bias, True)
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _packed_linears():
        return torch.ops.kernels.linear.default(x, weight, bias)
    return F.linear(x, weight, bias)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               part_rows: tuple[int, ...]) -> torch.Tensor:
    """LoRA adapters' delta for a linear's rows, each token with its own adapter (punica's
    shrink-then-expand): x [T, K], a [S, R, K], b [S, N, R] with the adapters' scaling folded into
    b, slots [T] int64 -> [T, N], token t's `b[s] @ (a[s] @ x[t])` for its slot s; slot -1 is the
    last slot, which holds zeros (tokens without an adapter). `part_rows`: the P + 1 row boundaries
    of B's projections (q / k / v, gate / up), B being block-diagonal: projection p's rows are zero
    but in the p-th R / P columns. Each token's result depends on its own row and adapter only:
    batch-invariant whatever the step's other adapters; no host sync.
    The op `kernels::lora_delta`: on CUDA Triton's kernels (`kernels.triton.lora`, each token's
    adapter read in place, sums in fp32), on the CPU the native grouped GEMM (native/lora.cpp: the
    tokens of each adapter in tiles, sums in fp32; docs/benchmarks.md, "LoRA adapters"). Without
    either, the portable torch code (`kernels.portable.lora`), called directly so that it is traced
    into the graphs (inductor fuses its gathers into the batched GEMVs)."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and _native_loaded):
        return torch.ops.kernels.lora_delta.default(x, a, b, slots, part_rows)
    return portable_lora.lora_delta(x, a, b, slots, part_rows)


def embedding(ids: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    """`F.embedding`; rows of a `PackedWeight` are dequantized (to fp32) as they are looked up."""
    if isinstance(weight, PackedWeight):
        fmt = weight.format
        if fmt.rows > 1:
            blocks, fmt = interleave.rows_of(weight.blocks, fmt, ids), FORMATS[fmt.base]
        else:
            blocks = weight.blocks[ids]
        return torch.ops.kernels.dequantize.default(blocks, fmt.code, weight.in_features)
    return F.embedding(ids, weight)


def prepare_packed(weight: PackedWeight, compute_dtype: torch.dtype) -> None:
    """Put a packed weight that a linear reads, once loaded, in the layout the linear runs fastest
    on here: on the CPU with bf16 activations and the native kernels, 16 rows interleaved (its rows
    a multiple of 16), which native/packed_linear_x16.cpp reads a vector of 16 output columns from.
    Elsewhere it stays as the file has it (the portable path dequantizes the file's blocks). An
    embedding that only looks rows up is better left as it is (the loader does)."""
    fmt = interleave.interleaved_format(weight.format)
    if (fmt is None or weight.out_features % interleave.ROWS
            or weight.blocks.device.type != "cpu" or compute_dtype != torch.bfloat16
            or not _cpu_kernels_loaded()):
        return
    rows = weight.blocks.reshape(-1, weight.blocks.shape[-1])  # experts: 16 rows never span two
    groups = interleave.interleave(rows, weight.format)
    weight.relayout(groups.view(*weight.blocks.shape[:-2], -1, groups.shape[-1]), fmt)


def extend_request_counts(max_requests: int, device: torch.device) -> list[int]:
    """Request counts (padding included) at which extend steps meet every compiled variant of the
    device's extend kernels: the warm-up runs one step of each, so that serving compiles none. []
    off CUDA."""
    if device.type != "cuda":
        return []
    from kernels.triton import attention

    return [min(block, max_requests) for block in attention.extend_block_sizes(max_requests)]


def _store_kv_cuda(k_cache, v_cache, k, v, slots) -> None:
    from kernels.triton import attention

    attention.store_kv_triton(k_cache, v_cache, k, v, slots)


def _decode_attention_cuda(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    scale,
    sliding_window=0,
    soft_cap=0.0,
    invariant=False,
):
    from kernels.triton import attention

    return attention.decode_attention_triton(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        scale,
        sliding_window,
        soft_cap,
        num_splits=1 if invariant else None,
    )


def _extend_attention_cuda(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_q_lens,
    seq_lens,
    scale,
    sliding_window=0,
    soft_cap=0.0,
    invariant=False,
):
    from kernels.triton import attention

    launch = (
        attention.extend_attention_invariant_triton
        if invariant
        else attention.extend_attention_triton
    )
    return launch(
        q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap
    )


def _fused_moe_cuda(x, w13, w2, topk_weights, topk_ids, invariant=False, w13_format=-1,
                    w2_format=-1):
    from kernels.triton import moe

    inter = portable_moe.expert_rows(w13, w13_format) // 2
    out, counts = moe.fused_moe_triton(
        x, _dense_experts(w13, w13_format, x.shape[-1], x.dtype),
        _dense_experts(w2, w2_format, inter, x.dtype), topk_weights, topk_ids)
    expert_load.record(w13, counts)
    return out


def _dense_experts(w: torch.Tensor, format: int, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Stacked experts as [E, N, K] in `dtype`: packed blocks dequantized (the Triton MoE kernels
    read dense weights)."""
    return w if format < 0 else dequantize_stack(w, format, in_features).to(dtype)


def _lora_delta_cuda(x, a, b, slots, part_rows):
    from kernels.triton import lora

    return lora.lora_delta_triton(x, a, b, slots, part_rows)


def _linear_cuda(x, weight, bias=None, invariant=False):
    if not invariant:
        return F.linear(x, weight, bias)
    from kernels.triton import matmul

    return matmul.invariant_linear_triton(x, weight, bias)


def _linear_packed_cuda(x, blocks, format, in_features, bias=None, invariant=False):
    from kernels.triton import packed

    fmt = BY_CODE[format]
    if not packed.supports(fmt):  # K-quants, interleaved layouts: dequantize, then fp32
        return portable_dequantize.linear_packed(x, blocks, format, in_features, bias, invariant)
    return packed.packed_linear_triton(x, blocks, fmt, in_features, bias)


_lib.impl("store_kv", _store_kv_cuda, "CUDA")
_lib.impl("linear_packed", _linear_packed_cuda, "CUDA")
_lib.impl("linear", _linear_cuda, "CUDA")
_lib.impl("fused_moe", _fused_moe_cuda, "CUDA")
_lib.impl("lora_delta", _lora_delta_cuda, "CUDA")
_lib.impl("decode_attention", _decode_attention_cuda, "CUDA")
_lib.impl("extend_attention", _extend_attention_cuda, "CUDA")


@torch.library.register_fake("kernels::store_kv")
def _(k_cache, v_cache, k, v, slots) -> None:
    return None


@torch.library.register_fake("kernels::decode_attention")
def _(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    scale,
    sliding_window=0,
    soft_cap=0.0,
    invariant=False,
):
    return torch.empty_like(q)


@torch.library.register_fake("kernels::extend_attention")
def _(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window=0, soft_cap=0.0,
      invariant=False):
    return torch.empty_like(q)


@torch.library.register_fake("kernels::linear")
def _(x, weight, bias=None, invariant=False):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("kernels::linear_packed")
def _(x, blocks, format, in_features, bias=None, invariant=False):
    return x.new_empty(*x.shape[:-1], blocks.shape[0] * BY_CODE[format].rows)


@torch.library.register_fake("kernels::dequantize")
def _(blocks, format, in_features):
    rows = BY_CODE[format].rows
    if rows > 1:
        return blocks.new_empty(blocks.shape[0] * rows, in_features, dtype=torch.float32)
    return blocks.new_empty(*blocks.shape[:-1], in_features, dtype=torch.float32)


@torch.library.register_fake("kernels::fused_moe")
def _(x, w13, w2, topk_weights, topk_ids, invariant=False, w13_format=-1, w2_format=-1):
    return torch.empty_like(x)


@torch.library.register_fake("kernels::lora_delta")
def _(x, a, b, slots, part_rows):
    return x.new_empty(x.shape[0], b.shape[1])


@torch.library.register_fake("kernels::argmax")
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


@functools.cache
def load_cpu_kernels() -> bool:
    """Build and load the native CPU kernels (once per process): True when they now serve the CPU,
    False when the portable implementations do (no compiler, `COMPILED_ENGINE_NATIVE=0`, a failed
    build)."""
    global _native_loaded
    _native_loaded = build.load()
    return _native_loaded


# whether the native CPU kernels serve the CPU (a constant where code is traced)
_native_loaded = False


def native_loaded() -> bool:
    """Whether the native CPU kernels serve the CPU (False until `kernels.init` loads them)."""
    return _native_loaded


def _cpu_kernels_loaded() -> bool:
    """Whether `kernels.init` has loaded the native CPU kernels (without loading them)."""
    return load_cpu_kernels.cache_info().currsize > 0 and load_cpu_kernels()


def isa_level() -> str:
    """The `COMPILED_ENGINE_CPU_ISA` level in force (`kernels.cpu.isa`): part of what compiled code
    depends on."""
    return isa.level()


def native_isa() -> set[str] | None:
    """The ISA extensions the native kernels were built with (None when they are not loaded)."""
    return build.compiled_isa() if load_cpu_kernels() else None


def cpu_has_avx2() -> bool:
    """Whether the CPU has AVX2 and FMA, which the native kernels' vector paths need (else they run
    scalar code)."""
    return {"avx2", "fma"} <= isa.cpu_flags()


def amx_available() -> bool:
    """Whether the AMX bf16 kernels (linear, extend attention) run here."""
    return load_cpu_kernels() and build.amx_available()


# What the native kernels::linear does with a CPU weight (native/torch_ops.cpp, `Kind`).
LINEAR_ROUTES = ("amx", "onednn_bf16", "onednn_fp32", "blas_fp32", "invariant", "invariant_dpbf16")


def linear_route(weight: torch.Tensor, invariant: bool) -> str:
    """The route of a CPU weight through kernels::linear, by name ("portable" without the native
    library)."""
    if not load_cpu_kernels():
        return "portable"
    return LINEAR_ROUTES[torch.ops.kernels.linear_route(weight, invariant)]

