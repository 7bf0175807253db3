"""Compile every Triton kernel for sm_90 without a GPU (run by test_kernels_triton_compile in a
fresh process with TRITON_INTERPRET unset, since the interpreter replaces the kernels at
decoration)."""

import triton
from triton.backends.compiler import GPUTarget

from kernels.triton.decode import decode_merge_kernel, decode_split_kernel
from kernels.triton.extend import extend_kernel
from kernels.triton.matmul import invariant_matmul_kernel
from kernels.triton.moe import moe_down_kernel, moe_gate_up_kernel
from kernels.triton.store import store_kv_kernel

FLOATS = ("scale", "soft_cap")


def compile_for_hopper(fn: triton.JITFunction, pointers: dict[str, str], constants: dict) -> None:
    """Ints not in `constants` are runtime i32; an int equal to 1 in `constants` mimics the
    launcher's specialization of 1-valued arguments."""
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in FLOATS else "i32")
    triton.compile(
        triton.compiler.ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32)
    )


def main() -> None:
    kv = {"k_cache": "*bf16", "v_cache": "*bf16"}
    compile_for_hopper(
        store_kv_kernel,
        {**kv, "k": "*bf16", "v": "*bf16", "slots": "*i64"},
        {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128},
    )
    decode = {
        **kv,
        "q": "*bf16",
        "page_table": "*i32",
        "seq_lens": "*i32",
        "query_rows": "*i32",
        "part_out": "*fp32",
        "part_lse": "*fp32",
    }
    # (the last: deterministic mode's extend, one split and a page-table row per query)
    for head_dim, block_n, soft_cap, rows in (
        (64, 64, False, False),
        (256, 32, True, False),
        (128, 64, False, True),
    ):
        extra = {"sliding_window": 1} if soft_cap else {}
        compile_for_hopper(
            decode_split_kernel,
            decode,
            {"GROUP": 4, "NUM_HEADS": 8, "NUM_SPLITS": 1 if rows else 4, "HEAD_DIM": head_dim,
             "BLOCK_H": 16, "BLOCK_N": block_n, "BLOCK_D": head_dim, "SOFT_CAP": soft_cap,
             "DOT_FP32": False, "QUERY_ROWS": rows, **extra},
        )  # fmt: skip
    compile_for_hopper(
        decode_merge_kernel,
        {"part_out": "*fp32", "part_lse": "*fp32", "out": "*bf16"},
        {"NUM_HEADS": 8, "NUM_SPLITS": 4, "HEAD_DIM": 128, "BLOCK_S": 4, "BLOCK_D": 128},
    )
    extend = {
        **kv,
        "q": "*bf16",
        "page_table": "*i32",
        "cu_q_lens": "*i32",
        "seq_lens": "*i32",
        "out": "*bf16",
    }
    for soft_cap, extra in (
        (False, {}),
        (True, {"sliding_window": 1, "num_rows": 1, "BLOCK_B": 1}),
    ):
        compile_for_hopper(
            extend_kernel,
            extend,
            {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_B": 4, "BLOCK_M": 64, "BLOCK_N": 64,
             "BLOCK_D": 128, "SOFT_CAP": soft_cap, "DOT_FP32": False, **extra},
        )  # fmt: skip
    for bias in (False, True):  # deterministic mode's linear
        compile_for_hopper(
            invariant_matmul_kernel,
            {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "out": "*bf16"},
            {"HAS_BIAS": bias, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_FP32": False},
        )
    moe = {"rows": "*i64", "block_expert": "*i32", "scratch": "*bf16"}
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_FP32": False}
    compile_for_hopper(moe_gate_up_kernel, moe | {"x": "*bf16", "w13": "*bf16"}, tiles)
    compile_for_hopper(moe_down_kernel, moe | {"w2": "*bf16", "out": "*bf16"}, tiles)


if __name__ == "__main__":
    main()
