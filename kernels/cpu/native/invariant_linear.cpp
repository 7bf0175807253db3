// The batch-invariant linear: out = x @ w.T (+ bias) where each output element is one fused multiply-add
// chain over k = 0 .. K-1 in order, starting from zero, in float32, then the bias added and the result
// rounded once. Nothing about a row's result depends on how many rows there are, which rows are next to
// it, how the threads split the work or which ISA ran it (an FMA is exactly rounded: the AVX512, AVX2 and
// scalar paths give the same bits). The kernel behind kernels::linear in deterministic mode (torch_ops.cpp).
//
// The weight [N, K] (bf16 or float32) is packed once into panels of kNr output columns, k-major: panel p
// holds, for each k, its kNr values side by side (zeros past N). A micro-tile of up to kMr rows x kNr
// columns keeps its sums in registers over a block of kKc steps of k, then in a float32 scratch tile
// between blocks (a store and a reload are exact, so blocking does not change the chain).

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const uint16_t* p) { return load16_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VecF vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline VecF vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#else
// Portable: eight lanes in an array, each step std::fma (exactly rounded, like the intrinsics).
constexpr int kLanes = 8;
struct VecF {
    float v[kLanes];
};
inline VecF vzero() { return VecF{}; }
inline VecF vload(const float* p) {
    VecF r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
    return r;
}
inline VecF vload(const uint16_t* p) {
    VecF r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = bf16_to_f32(p[i]);
    return r;
}
inline VecF vbroadcast(const float* p) {
    VecF r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = *p;
    return r;
}
inline VecF vfma(VecF a, VecF b, VecF c) {
    for (int i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
}
inline void vstore(float* p, VecF v) {
    for (int i = 0; i < kLanes; ++i) p[i] = v.v[i];
}
#endif

// The micro-tile per weight type: kMr rows x kNv vectors of accumulators (float32 weights favour more rows
// per weight load, bf16 ones fewer conversions per row; docs/benchmarks.md). Panels are kNr columns wide.
template <typename W>
struct Tile {
#if defined(__AVX512F__)
    static constexpr int kMr = 8, kNv = 3;  // 24 accumulators of 32 registers
#else
    static constexpr int kMr = std::is_same_v<W, float> ? 6 : 4, kNv = std::is_same_v<W, float> ? 2 : 3;
#endif
    static constexpr int64_t kNr = kNv * kLanes;
};
constexpr int64_t kKc = 256;  // steps of k per register block
constexpr int64_t kMc = 48;   // rows per task (a multiple of every kMr)

// Rows [0, R) x the panel's kNr columns over k in [k0, k1): c (R x kNr floats) holds the sums so far,
// or nothing yet when k0 == 0.
template <int R, typename W>
inline void micro_tile(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, float* c) {
    constexpr int kNv = Tile<W>::kNv;
    constexpr int64_t kNr = Tile<W>::kNr;
    VecF acc[R][kNv];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < kNv; ++v) acc[r][v] = k0 == 0 ? vzero() : vload(c + r * kNr + v * kLanes);
    for (int64_t k = k0; k < k1; ++k) {
        VecF w[kNv];
        for (int v = 0; v < kNv; ++v) w[v] = vload(panel + k * kNr + v * kLanes);
        for (int r = 0; r < R; ++r) {
            const VecF a = vbroadcast(x + r * ldx + k);
            for (int v = 0; v < kNv; ++v) acc[r][v] = vfma(a, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < kNv; ++v) vstore(c + r * kNr + v * kLanes, acc[r][v]);
}

// One micro-tile of `rows` <= kMr rows (the row count picks the instantiation, never the arithmetic).
template <typename W, int R = Tile<W>::kMr>
void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, float* c) {
    if constexpr (R > 1)
        if (rows < R) return tile_rows<W, R - 1>(rows, x, ldx, panel, k0, k1, c);
    micro_tile<R>(x, ldx, panel, k0, k1, c);
}

template <typename W>
void pack(const W* w, W* out, int64_t N, int64_t K) {
    constexpr int64_t kNr = Tile<W>::kNr;
    const int64_t panels = (N + kNr - 1) / kNr;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < kNr; ++j) {
                const int64_t n = p * kNr + j;
                out[(p * K + k) * kNr + j] = n < N ? w[n * K + k] : W{};
            }
}

// out [M, N] (element type O) = x [M, K] float32 @ the packed weight (+ bias, float32 or null). Tasks are
// (panel, block of kMc rows) pairs: every element is still one thread's one chain.
template <typename W, typename O>
void linear(const float* x, const W* packed, const float* bias, O* out, int64_t M, int64_t N, int64_t K) {
    constexpr int kMr = Tile<W>::kMr;
    constexpr int64_t kNr = Tile<W>::kNr;
    const int64_t panels = (N + kNr - 1) / kNr, blocks = (M + kMc - 1) / kMc;
#pragma omp parallel
    {
        std::vector<float> c(kMc * kNr);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < panels * blocks; ++task) {
            const int64_t p = task % panels, m0 = task / panels * kMc, rows = std::min(kMc, M - m0);
            const int64_t n0 = p * kNr, cols = std::min(kNr, N - n0);
            const W* panel = packed + p * K * kNr;
            for (int64_t k0 = 0; k0 < K; k0 += kKc) {
                const int64_t k1 = std::min(K, k0 + kKc);
                for (int64_t r = 0; r < rows; r += kMr)
                    tile_rows(static_cast<int>(std::min<int64_t>(kMr, rows - r)), x + (m0 + r) * K, K, panel, k0, k1,
                              c.data() + r * kNr);
            }
            if (K == 0) std::fill(c.begin(), c.end(), 0.0f);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < cols; ++j) {
                    const float v = c[r * kNr + j] + (bias ? bias[n0 + j] : 0.0f);
                    if constexpr (std::is_same_v<O, float>)
                        out[(m0 + r) * N + n0 + j] = v;
                    else
                        out[(m0 + r) * N + n0 + j] = f32_to_bf16(v);
                }
        }
    }
}

}  // namespace

extern "C" {

int64_t ce_invariant_packed_size(int w_dt, int64_t N, int64_t K) {
    const int64_t nr = w_dt == 0 ? Tile<float>::kNr : Tile<uint16_t>::kNr;
    return (N + nr - 1) / nr * nr * K;
}

// w_dt / out_dt: 0 float32, 1 bfloat16.
void ce_invariant_pack(int w_dt, const void* w, void* out, int64_t N, int64_t K) {
    if (w_dt == 0)
        pack(static_cast<const float*>(w), static_cast<float*>(out), N, K);
    else
        pack(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), N, K);
}

void ce_invariant_linear(int w_dt, const float* x, const void* packed, const float* bias, void* out, int64_t M,
                         int64_t N, int64_t K) {
    if (w_dt == 0)
        linear(x, static_cast<const float*>(packed), bias, static_cast<float*>(out), M, N, K);
    else
        linear(x, static_cast<const uint16_t*>(packed), bias, static_cast<uint16_t*>(out), M, N, K);
}

}  // extern "C"
