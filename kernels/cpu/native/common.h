// Shared by the native CPU kernels (kernels/cpu/native/*.cpp, built by kernels/cpu/build.py): bf16 <-> float32
// element types and 16-lane loads. Plain C++ and intrinsics, no torch headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7FC0;
    u += 0x7FFF + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}

// Element types of the kernels' templates (codes `dt`: 0 float32, 1 bfloat16, 2 float16).
struct F32 {
    using T = float;
    static float load(T x) { return x; }
    static T store(float x) { return x; }
};
struct BF16 {
    using T = uint16_t;
    static float load(T x) { return bf16_to_f32(x); }
    static T store(float x) { return f32_to_bf16(x); }
};
struct F16 {
    using T = _Float16;
    static float load(T x) { return static_cast<float>(x); }
    static T store(float x) { return static_cast<T>(x); }
};

#if defined(__AVX512F__)
inline __m512 load16_bf16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) { return load16_bf16(_mm256_loadu_si256((const __m256i*)x)); }
inline __m512 load16(const _Float16* x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x)); }
#endif

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// GCC's tileloadd carries no memory clobber: without this barrier the compiler may sink ordinary stores
// (a softmax writing the probabilities) below the tile load that reads them.
inline void tile_loads_see_stores() { asm volatile("" ::: "memory"); }

// This thread's 8 AMX tiles, 64 bytes wide: the first `short_tiles` have `rows` rows, the rest 16.
inline void configure_amx_tiles(int rows, int short_tiles) {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = t < short_tiles ? rows : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#endif

}  // namespace
