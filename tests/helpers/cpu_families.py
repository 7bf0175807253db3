"""x86 CPU families' /proc/cpuinfo flags, injected by the ISA tests to check each on any CPU."""

from __future__ import annotations

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd"}
FAMILIES = {
    # Sapphire Rapids: AMX tiles, AVX512-BF16, VNNI
    "amx_xeon": AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    # Zen4 / Zen5: AVX512-BF16 and VNNI, no AMX
    "zen4": AVX512 | {"avx512_vnni", "avx512_bf16"},
    # Skylake-SP: AVX512 without BF16 or VNNI
    "skylake_x": AVX512,
    # Zen3: AVX2 only
    "zen3": AVX2,
    # Knights Landing: AVX512F (and CD, ER, PF) without BW / DQ / VL: not AVX512 to ATen or inductor
    "knl": AVX2 | {"avx512f", "avx512cd", "avx512er", "avx512pf"},
}
