// Batch-invariant paged attention: the kernel of kernels::decode_attention and extend_attention in
// deterministic mode on builds without AVX512 (AVX2 x86, ARM: torch_ops.cpp; with AVX512 the decode kernel
// of attention.cpp serves the mode). A decode step is an extend of one token per row, so both ops run the
// one routine below, and every query row's result is a function of its own query and the keys and values
// it attends to, never of the batch, the chunking of its prompt or what is cached (the scalar and the AVX2
// forms give the same bits):
//     score_t = dot(q, k_t) * scale (soft-capped), dot in eight fused multiply-add chains over d mod 8
//               summed in a fixed tree;
//     weights = softmax over the query's own keys, in full (no split of the keys), exp by one polynomial,
//               the sum in eight lanes over t mod 8 and the same tree;
//     out     = sum over t in order of weight_t * v_t, one fused multiply-add chain per element.
// The query rows of one task (a request's block of tokens x the query heads of one KV head) share each
// K / V row read; which rows share a task changes the speed, not a bit of the result.
//
// Element type codes (`dt`): 0 float32, 1 bfloat16, 2 float16. Layouts as attention.cpp: caches
// [S, Hkv, D], q / out [T, H, D] (q rows `q_stride` elements apart), page-table rows of raw slots.

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockTokens = 8;  // query tokens per task

// sum over d of a[d] * b[d]: lane j = d mod 8 is one FMA chain, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
inline float dot8(const float* a, const float* b, int64_t n) {
    alignas(32) float lane[8] = {};
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    _mm256_store_ps(lane, acc);
#endif
    for (; d < n; ++d) lane[d % 8] = std::fma(a[d], b[d], lane[d % 8]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// acc[d] = fma(w, v[d], acc[d]).
inline void axpy(float w, const float* v, float* acc, int64_t n) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 wv = _mm256_set1_ps(w);
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < n; ++d) acc[d] = std::fma(w, v[d], acc[d]);
}

#if defined(__AVX2__) && defined(__FMA__)
// The vectorized path (AVX2, float32 and bf16 caches, D % 8 == 0): the same operations in the same order as
// dot8 and axpy, with the K / V rows converted in registers and four query rows (or eight columns) at once.
template <typename E>
struct Fast : std::bool_constant<std::is_same_v<E, F32> || std::is_same_v<E, BF16>> {};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// dot8(q[j], k) for four rows j: three horizontal adds make each row's tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
template <typename T>
inline __m128 dot8x4(const float* const q[4], const T* k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv = load8(k + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q[0] + d), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q[1] + d), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q[2] + d), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q[3] + d), kv, a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[0:D] = sum over t in order of w[t] * rows[t][0:D] (axpy's chains), up to 64 columns per pass in registers.
template <typename T, int NC>
inline void weighted_columns(const float* w, const void* const* rows, int64_t n, int64_t c0, float* acc) {
    __m256 a[NC];
    for (int c = 0; c < NC; ++c) a[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
        const __m256 wt = _mm256_set1_ps(w[t]);
        const T* v = static_cast<const T*>(rows[t]) + c0;
        for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(wt, load8(v + 8 * c), a[c]);
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
}

template <typename T>
void weighted_values(const float* w, const void* const* rows, int64_t n, float* acc, int64_t D) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        switch (std::min<int64_t>(8, (D - c0) / 8)) {
            case 1: weighted_columns<T, 1>(w, rows, n, c0, acc); break;
            case 2: weighted_columns<T, 2>(w, rows, n, c0, acc); break;
            case 3: weighted_columns<T, 3>(w, rows, n, c0, acc); break;
            case 4: weighted_columns<T, 4>(w, rows, n, c0, acc); break;
            case 5: weighted_columns<T, 5>(w, rows, n, c0, acc); break;
            case 6: weighted_columns<T, 6>(w, rows, n, c0, acc); break;
            case 7: weighted_columns<T, 7>(w, rows, n, c0, acc); break;
            default: weighted_columns<T, 8>(w, rows, n, c0, acc); break;
        }
    }
}
#endif

// e^x for x <= 0: Cephes' polynomial with every step an explicit FMA (no contraction left to the compiler).
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = std::fma(n, 2.12194440e-4f, std::fma(-n, 0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p * r, r, r) + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on eight lanes, step for step (an FMA is an FMA; rounding to nearest is nearbyint's).
inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// p[0:n] becomes softmax(p[0:n]). The sum: lane j = t mod 8 adds its terms in order, then the lanes' tree
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), as in dot8.
inline void softmax(float* p, int64_t n) {
    float m = p[0];
    for (int64_t t = 1; t < n; ++t) m = std::max(m, p[t]);
    alignas(32) float lane[8] = {};
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv));
        _mm256_storeu_ps(p + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    _mm256_store_ps(lane, sv);
#endif
    for (; t < n; ++t) {
        p[t] = exp_nonpositive(p[t] - m);
        lane[t % 8] += p[t];
    }
    const float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    const float inv = 1.0f / sum;
    for (t = 0; t < n; ++t) p[t] *= inv;
}

struct Task {
    int64_t req, kh, first, count;  // request, KV head, its first query token (row of q) and how many
};

struct Scratch {
    std::vector<float> q, scores, acc, row;
    std::vector<const void*> k_rows, v_rows;  // the task's K / V rows, by key (the fast path)
};

// One task: `count` consecutive query tokens of request `req` (positions pos0 ...) x the G query heads of
// KV head kh. Query r = (token i, head g) attends to keys [lo_i, pos0 + i + 1).
template <typename E>
void attend(const Task& task, const typename E::T* q, int64_t q_stride, const typename E::T* k_cache,
            const typename E::T* v_cache, const int32_t* slots, int64_t pos0, typename E::T* out, int64_t H,
            int64_t Hkv, int64_t D, int64_t S, float scale, int64_t window, float soft_cap, Scratch& s) {
    const int64_t G = H / Hkv, rows = task.count * G;
    const int64_t hi_max = pos0 + task.count;
    auto lo = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, pos0 + i + 1 - window) : 0; };
    const int64_t lo_min = lo(0), span = hi_max - lo_min;
    s.q.resize(rows * D);
    s.scores.resize(rows * span);
    s.acc.assign(rows * D, 0.0f);
    s.row.resize(D);
    for (int64_t i = 0; i < task.count; ++i)
        for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d)
                s.q[(i * G + g) * D + d] = E::load(q[(task.first + i) * q_stride + (task.kh * G + g) * D + d]);
    auto kv_row = [&](const typename E::T* cache, int64_t t) {
        const int64_t slot = slots[t] < 0 || slots[t] >= S ? 0 : slots[t];
        const typename E::T* src = cache + (slot * Hkv + task.kh) * D;
        for (int64_t d = 0; d < D; ++d) s.row[d] = E::load(src[d]);
    };
    // Row r = (token i, head g) attends to keys [lo(i), pos0 + i + 1); its scores start at scores[r * span].
    auto row_lo = [&](int64_t r) { return lo(r / G); };
    auto row_hi = [&](int64_t r) { return pos0 + r / G + 1; };
    auto keep = [&](int64_t r, int64_t t, float v) {
        if (soft_cap > 0.0f) v = soft_cap * std::tanh(v / soft_cap);
        s.scores[r * span + (t - row_lo(r))] = v;
    };
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (Fast<E>::value) {
        if (D % 8 == 0) {
            s.k_rows.resize(span);
            s.v_rows.resize(span);
            for (int64_t t = lo_min; t < hi_max; ++t) {
                const int64_t slot = slots[t] < 0 || slots[t] >= S ? 0 : slots[t];
                s.k_rows[t - lo_min] = k_cache + (slot * Hkv + task.kh) * D;
                s.v_rows[t - lo_min] = v_cache + (slot * Hkv + task.kh) * D;
            }
            // Four rows at a time over the union of their keys (a row past `rows` repeats the last one).
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const float* qr[4];
                for (int j = 0; j < 4; ++j) qr[j] = s.q.data() + std::min(r0 + j, rows - 1) * D;
                const int64_t last = std::min(r0 + 3, rows - 1);
                for (int64_t t = row_lo(r0); t < row_hi(last); ++t) {
                    alignas(16) float v[4];
                    _mm_store_ps(v, dot8x4(qr, static_cast<const typename E::T*>(s.k_rows[t - lo_min]), D));
                    for (int64_t j = 0; j < 4 && r0 + j < rows; ++j)
                        if (row_lo(r0 + j) <= t && t < row_hi(r0 + j)) keep(r0 + j, t, v[j] * scale);
                }
            }
            for (int64_t r = 0; r < rows; ++r) softmax(s.scores.data() + r * span, row_hi(r) - row_lo(r));
            for (int64_t r = 0; r < rows; ++r)
                weighted_values<typename E::T>(s.scores.data() + r * span, s.v_rows.data() + (row_lo(r) - lo_min),
                                               row_hi(r) - row_lo(r), s.acc.data() + r * D, D);
        }
    }
    if (!(Fast<E>::value && D % 8 == 0)) {
#else
    {
#endif
        for (int64_t t = lo_min; t < hi_max; ++t) {
            kv_row(k_cache, t);
            for (int64_t r = std::max<int64_t>(0, t - pos0) * G; r < rows && row_lo(r) <= t; ++r)
                keep(r, t, dot8(s.q.data() + r * D, s.row.data(), D) * scale);
        }
        for (int64_t r = 0; r < rows; ++r) softmax(s.scores.data() + r * span, row_hi(r) - row_lo(r));
        for (int64_t t = lo_min; t < hi_max; ++t) {
            kv_row(v_cache, t);
            for (int64_t r = std::max<int64_t>(0, t - pos0) * G; r < rows && row_lo(r) <= t; ++r)
                axpy(s.scores[r * span + (t - row_lo(r))], s.row.data(), s.acc.data() + r * D, D);
        }
    }
    for (int64_t i = 0; i < task.count; ++i)
        for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d)
                out[(task.first + i) * H * D + (task.kh * G + g) * D + d] = E::store(s.acc[(i * G + g) * D + d]);
}

// Request b owns query rows cu[b] .. cu[b + 1]: the last positions of its seq_lens[b] tokens. Rows of no
// request, or of a request of length 0, are left as they are (the caller zeroes them).
template <typename E>
void invariant_attention(const typename E::T* q, int64_t q_stride, const typename E::T* k_cache,
                         const typename E::T* v_cache, const int32_t* table, int64_t table_stride, const int32_t* cu,
                         const int32_t* seq_lens, typename E::T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                         int64_t S, float scale, int64_t window, float soft_cap) {
    std::vector<Task> tasks;
    for (int64_t b = 0; b < B; ++b) {
        if (seq_lens[b] <= 0) continue;
        for (int64_t first = cu[b]; first < cu[b + 1]; first += kBlockTokens)
            for (int64_t kh = 0; kh < Hkv; ++kh)
                tasks.push_back({b, kh, first, std::min<int64_t>(kBlockTokens, cu[b + 1] - first)});
    }
#pragma omp parallel
    {
        thread_local Scratch scratch;  // kept between calls: no allocation per step
#pragma omp for schedule(dynamic, 1)
        for (size_t j = 0; j < tasks.size(); ++j) {
            const Task& task = tasks[j];
            const int64_t q_len = cu[task.req + 1] - cu[task.req];
            const int64_t pos0 = seq_lens[task.req] - q_len + (task.first - cu[task.req]);
            attend<E>(task, q, q_stride, k_cache, v_cache, table + task.req * table_stride, pos0, out, H, Hkv, D, S,
                      scale, window, soft_cap, scratch);
        }
    }
}

}  // namespace

extern "C" {

int ce_invariant_attention(int dt, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                           const int32_t* table, int64_t table_stride, const int32_t* cu_q_lens,
                           const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                           float scale, int64_t window, float soft_cap) {
#define CE_ATTEND(E)                                                                                              \
    invariant_attention<E>(static_cast<const E::T*>(q), q_stride, static_cast<const E::T*>(k_cache),              \
                           static_cast<const E::T*>(v_cache), table, table_stride, cu_q_lens, seq_lens,           \
                           static_cast<E::T*>(out), B, H, Hkv, D, S, scale, window, soft_cap)
    switch (dt) {
        case 0: CE_ATTEND(F32); return 0;
        case 1: CE_ATTEND(BF16); return 0;
        case 2: CE_ATTEND(F16); return 0;
        default: return -1;
    }
#undef CE_ATTEND
}

}  // extern "C"
