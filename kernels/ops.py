"""The attention, KV-store and CPU linear ops (`torch.ops.kernels.*`): Triton on CUDA; on the CPU the
native kernels of `cpu_native` where they apply, torch otherwise. When the native library loads, its C++
kernels serve the CPU (a compiled graph calls them without entering Python: ~20 us saved per call) and
hand what they decline to `kernels::<op>_torch`, the torch implementations below; without the library
those serve the CPU directly.

Each op is opaque to torch.compile (one node, a fake implementation for shapes). They are defined with
`torch.library.Library` and per-device implementations rather than `torch.library.custom_op`, whose
Python wrapper costs ~30 us per call of a mutating op: more than the CPU decode attention itself.
The Triton module is imported on first CUDA use only, so that tests can set TRITON_INTERPRET before
anything decorates a kernel.
"""

import torch

from kernels import cpu_attention, cpu_linear, cpu_native

_lib = torch.library.Library("kernels", "DEF")
_SCHEMAS = {
    "store_kv": "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()",
    "decode_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, float scale, "
    "int page_size, int sliding_window=0, float soft_cap=0.0) -> Tensor",
    "extend_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_q_lens, "
    "Tensor seq_lens, float scale, int page_size, int sliding_window=0, float soft_cap=0.0) -> Tensor",
    "cpu_linear": "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
}
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema)
    _lib.define(_name + "_torch" + _schema)  # the CPU torch implementation, where the C++ kernels decline

store_kv = torch.ops.kernels.store_kv.default
"""store_kv(k_cache, v_cache, k, v, slots): write k, v [T, Hkv, D] into the caches [S, Hkv, D] at `slots`
[T] int64; slots < 0 are skipped."""

decode_attention = torch.ops.kernels.decode_attention.default
"""decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window=0,
soft_cap=0.0): one new query per row, q [B, H, D] -> [B, H, D]; rows with seq_len 0 give zeros."""

extend_attention = torch.ops.kernels.extend_attention.default
"""extend_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size,
sliding_window=0, soft_cap=0.0): ragged new tokens q [T, H, D] -> [T, H, D]; request b's queries
cu_q_lens[b]:cu_q_lens[b+1] are its last positions and attend causally to the whole row (prefix included)."""

linear = torch.ops.kernels.cpu_linear.default
"""cpu_linear(x, weight, bias=None): `F.linear` for CPU bf16 weights, on weights packed once for the AMX
kernel or oneDNN (`kernels.cpu_linear`)."""


def _decode_attention_cpu(q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window=0,
                          soft_cap=0.0):
    return cpu_attention.decode_attention_cpu(q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window,
                                              soft_cap)


def _extend_attention_cpu(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size,
                          sliding_window=0, soft_cap=0.0):
    return cpu_attention.extend_attention_cpu(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale,
                                              sliding_window, soft_cap)


def _store_kv_cuda(k_cache, v_cache, k, v, slots) -> None:
    from kernels import triton_attention

    triton_attention.store_kv_triton(k_cache, v_cache, k, v, slots)


def _decode_attention_cuda(q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window=0,
                           soft_cap=0.0):
    from kernels import triton_attention

    return triton_attention.decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, scale, page_size,
                                                    sliding_window, soft_cap)


def _extend_attention_cuda(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size,
                           sliding_window=0, soft_cap=0.0):
    from kernels import triton_attention

    return triton_attention.extend_attention_triton(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale,
                                                    page_size, sliding_window, soft_cap)


# Loading the native library registers its C++ CPU kernels for the four ops (kernels/native/torch_ops.cpp):
# graphs then call them without entering Python. Without it, the Python implementations serve the CPU.
_cpp_kernels = cpu_native.library() is not None
for _name, _cpu in (
    ("store_kv", cpu_attention.store_kv_cpu),
    ("decode_attention", _decode_attention_cpu),
    ("extend_attention", _extend_attention_cpu),
    ("cpu_linear", cpu_linear.packed_linear),
):
    _lib.impl(_name + "_torch", _cpu, "CPU")
    if not _cpp_kernels:
        _lib.impl(_name, _cpu, "CPU")
for _name, _cuda in (
    ("store_kv", _store_kv_cuda),
    ("decode_attention", _decode_attention_cuda),
    ("extend_attention", _extend_attention_cuda),
):
    _lib.impl(_name, _cuda, "CUDA")


@torch.library.register_fake("kernels::store_kv")
def _(k_cache, v_cache, k, v, slots) -> None:
    return None


@torch.library.register_fake("kernels::decode_attention")
def _(q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window=0, soft_cap=0.0):
    return torch.empty_like(q)


@torch.library.register_fake("kernels::extend_attention")
def _(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size, sliding_window=0, soft_cap=0.0):
    return torch.empty_like(q)


@torch.library.register_fake("kernels::cpu_linear")
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
