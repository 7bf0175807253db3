// The batch-invariant bf16 linear on AVX512-BF16 (AMD Zen4 and later, Intel Cooper Lake / Sapphire Rapids):
// out = x @ w.T (+ bias) with bf16 x and w, where each output element is one chain of `vdpbf16ps` steps over
// the pairs of k (0,1), (2,3), ... in order, starting from zero, in float32, then the bias added and the result
// rounded once. Each step adds the two products of a pair to the running sum; the chain's order is fixed by K
// alone, so a row's result does not depend on how many rows there are or how threads split them. It is not
// the same bits as the FMA chain of invariant_linear.cpp (the pairs, and the instruction flushes denormals),
// so deterministic mode's results are those of the CPU's instruction set, as everywhere else.
//
// The weight [N, K] (K even) is packed once into panels of kNr output columns, pair-major: panel p holds, for
// each pair of k, its kNr columns' two values side by side (a 32-bit word per column; zeros past N). A
// micro-tile of up to kMr rows x kNr columns keeps its sums in registers over kKp pairs, then in a float32
// scratch tile between blocks (a store and a reload are exact, so blocking does not change the chain).

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kMr = 8, kNv = 3;               // 24 accumulators + 3 weight vectors of 32 registers
constexpr int64_t kNr = kNv * 16;             // columns per panel
constexpr int64_t kKp = 1024;                 // pairs of k per register block (the panel's slice stays in L2)
constexpr int64_t kMc = 48;                   // rows per task (a multiple of kMr)

// Rows [0, R) x the panel's kNr columns over pairs [p0, p1): c (R x kNr floats) holds the sums so far, or
// nothing yet when p0 == 0.
template <int R>
inline void micro_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t p0, int64_t p1, float* c) {
    __m512 acc[R][kNv];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < kNv; ++v) acc[r][v] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * kNr + v * 16);
    for (int64_t p = p0; p < p1; ++p) {
        __m512i w[kNv];
        for (int v = 0; v < kNv; ++v) w[v] = _mm512_loadu_si512(panel + (p * kNr + v * 16) * 2);
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
            const __m512i a = _mm512_set1_epi32(pair);
            for (int v = 0; v < kNv; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)w[v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < kNv; ++v) _mm512_storeu_ps(c + r * kNr + v * 16, acc[r][v]);
}

// One micro-tile of `rows` <= kMr rows (the row count picks the instantiation, never the arithmetic).
template <int R = kMr>
void tile_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t p0, int64_t p1, float* c) {
    if constexpr (R > 1)
        if (rows < R) return tile_rows<R - 1>(rows, x, ldx, panel, p0, p1, c);
    micro_tile<R>(x, ldx, panel, p0, p1, c);
}

void pack(const uint16_t* w, uint16_t* out, int64_t N, int64_t K) {
    const int64_t panels = (N + kNr - 1) / kNr, pairs = K / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t k = 0; k < pairs; ++k)
            for (int64_t j = 0; j < kNr; ++j) {
                const int64_t n = p * kNr + j;
                uint16_t* dst = out + ((p * pairs + k) * kNr + j) * 2;
                dst[0] = n < N ? w[n * K + 2 * k] : 0;
                dst[1] = n < N ? w[n * K + 2 * k + 1] : 0;
            }
}

// out [M, N] bf16 = x [M, K] bf16 @ the packed weight (+ bias, float32 or null). Tasks are (panel, block of
// kMc rows) pairs: every element is still one thread's one chain.
void linear(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* out, int64_t M, int64_t N,
            int64_t K) {
    const int64_t panels = (N + kNr - 1) / kNr, blocks = (M + kMc - 1) / kMc, pairs = K / 2;
#pragma omp parallel
    {
        std::vector<float> c(kMc * kNr, 0.0f);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < panels * blocks; ++task) {
            const int64_t p = task % panels, m0 = task / panels * kMc, rows = std::min(kMc, M - m0);
            const int64_t n0 = p * kNr, cols = std::min(kNr, N - n0);
            const uint16_t* panel = packed + p * pairs * kNr * 2;
            for (int64_t p0 = 0; p0 < pairs; p0 += kKp) {
                const int64_t p1 = std::min(pairs, p0 + kKp);
                for (int64_t r = 0; r < rows; r += kMr)
                    tile_rows(static_cast<int>(std::min<int64_t>(kMr, rows - r)), x + (m0 + r) * K, K, panel, p0, p1,
                              c.data() + r * kNr);
            }
            if (pairs == 0) std::fill(c.begin(), c.end(), 0.0f);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < cols; ++j)
                    out[(m0 + r) * N + n0 + j] = f32_to_bf16(c[r * kNr + j] + (bias ? bias[n0 + j] : 0.0f));
        }
    }
}

}  // namespace
#endif

extern "C" {

// 1 when this build has the AVX512-BF16 kernel (the CPU has the flag and COMPILED_ENGINE_CPU_ISA left it on).
int ce_dpbf16_available() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int64_t ce_dpbf16_packed_size(int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    return (N + kNr - 1) / kNr * kNr * K;
#else
    (void)N;
    (void)K;
    return 0;
#endif
}

// K must be even (the caller checks).
void ce_dpbf16_pack(const void* w, void* out, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    pack(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), N, K);
#else
    (void)w, (void)out, (void)N, (void)K;
#endif
}

void ce_dpbf16_linear(const void* x, const void* packed, const float* bias, void* out, int64_t M, int64_t N,
                      int64_t K) {
#if defined(__AVX512BF16__)
    linear(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(packed), bias, static_cast<uint16_t*>(out), M,
           N, K);
#else
    (void)x, (void)packed, (void)bias, (void)out, (void)M, (void)N, (void)K;
#endif
}

}  // extern "C"
