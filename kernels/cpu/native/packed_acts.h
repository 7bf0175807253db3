// Shared by the packed linears (packed_linear.cpp: the file's own blocks; packed_linear_x16.cpp: 16 rows
// interleaved): fp16 / bf16 scalars of a block, and the activations quantized to int16 per row and block of 32.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CE_PACKED_AVX2 1
#endif

namespace {

// Activations are quantized to int16: |q| <= kActMax.
constexpr float kActMax = 32767.0f;

inline float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0 && man == 0) {
        u = sign;
    } else if (exp == 0) {  // subnormal: normalize
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            --exp;
        }
        u = sign | (exp << 23) | ((man & 0x3FF) << 13);
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

inline float bf16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16_to_f32(h);
}

// The activations, quantized: row r's block j is q[r K + 32 j ..], with scale d[r nb + j] and s[r nb + j] =
// d * (sum of its 32 quants).
struct Acts {
    std::vector<int16_t> q;
    std::vector<float> d, s;
    int64_t K, nb;
};

#if defined(CE_PACKED_AVX2)
inline int hsum_i32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_hadd_epi32(x, x);
    x = _mm_hadd_epi32(x, x);
    return _mm_cvtsi128_si32(x);
}
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
#endif

// Row m of x (K values) -> int16 blocks of 32, d = max|x| / 32767 per block, q = round-to-nearest-even(x / d).
template <typename E>
void quantize_row(const typename E::T* x, int64_t K, int16_t* q, float* d, float* s) {
    for (int64_t j = 0; j < K / 32; ++j) {
#if defined(CE_PACKED_AVX2)
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; ++i) {
            v[i] = load8(x + 32 * j + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float scale = max_abs / kActMax, inv = max_abs > 0.0f ? kActMax / max_abs : 0.0f;
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
        // packs interleave 128-bit lanes: the permute puts the 16 values back in order
        for (int h = 0; h < 2; ++h) {
            const __m256i i16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2 * h], i32[2 * h + 1]), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * j + 16 * h), i16);
        }
#else
        float max_abs = 0.0f;
        for (int i = 0; i < 32; ++i) max_abs = std::max(max_abs, std::fabs(E::load(x[32 * j + i])));
        const float scale = max_abs / kActMax, inv = max_abs > 0.0f ? kActMax / max_abs : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
            const int v = static_cast<int>(std::nearbyint(E::load(x[32 * j + i]) * inv));
            q[32 * j + i] = static_cast<int16_t>(v);
            sum += v;
        }
#endif
        d[j] = scale;
        s[j] = scale * static_cast<float>(sum);
    }
}

// The M rows of x [M, K] quantized (in parallel where there are enough of them: each row on its own).
template <typename E>
Acts quantize_rows(const typename E::T* x, int64_t M, int64_t K) {
    Acts a{std::vector<int16_t>(M * K), std::vector<float>(M * (K / 32)), std::vector<float>(M * (K / 32)), K,
           K / 32};
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; ++m)
        quantize_row<E>(x + m * K, K, a.q.data() + m * K, a.d.data() + m * a.nb, a.s.data() + m * a.nb);
    return a;
}

}  // namespace
