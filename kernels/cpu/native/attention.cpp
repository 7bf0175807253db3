// Paged decode attention and the KV store on the CPU (AVX512 / AVX512-BF16 where the build has them),
// the CPU kernels of kernels::decode_attention and store_kv, and on an AVX512 build without the AMX extend
// kernel of kernels::extend_attention too, as one decode row per query token (torch_ops.cpp).
//
// Element type codes (`dt`): 0 float32, 1 bfloat16, 2 float16. Math is in float32.
// Layouts: caches [S, Hkv, D]; q / out [B, H, D] (q rows `q_stride` elements apart, else contiguous);
// k / v [T, Hkv, D].

#include <omp.h>

#include <type_traits>
#include <vector>

#include "common.h"

namespace {

// e^x for x <= 0 (softmax after subtracting the max), Cephes' polynomial: ~1 ulp, and unlike std::exp
// GCC vectorizes it.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

inline int64_t clamp_slot(int64_t slot, int64_t S) { return (slot < 0 || slot >= S) ? 0 : slot; }

inline float capped(float s, float soft_cap) { return soft_cap > 0.0f ? soft_cap * std::tanh(s / soft_cap) : s; }

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes (GCC leaves the scalar loop unvectorized once it is inlined into the kernels).
inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// Each of the G rows of p [G, n] becomes softmax(row).
inline void softmax_rows(float* p, int64_t G, int64_t n) {
    for (int64_t g = 0; g < G; ++g) {
        float* pg = p + g * n;
        float m = pg[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < n; ++t) m = pg[t] > m ? pg[t] : m;
        float sum = 0.0f;
        int64_t t = 0;
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sv = _mm512_setzero_ps();
        for (; t + 16 <= n; t += 16) {
            const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(pg + t), mv));
            _mm512_storeu_ps(pg + t, e);
            sv = _mm512_add_ps(sv, e);
        }
        sum = _mm512_reduce_add_ps(sv);
#endif
        for (; t < n; ++t) {
            pg[t] = exp_nonpositive(pg[t] - m);
            sum += pg[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) pg[i] *= inv;
    }
}

template <typename E>
inline void load_row(const typename E::T* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = E::load(src[i]);
}

// Positions ahead whose K / V rows are prefetched: decode tokens of one sequence sit in scattered slots,
// so without it every row is a cache miss the loop waits for.
constexpr int64_t kAhead = 8;

template <typename T>
inline void prefetch(const T* row, int64_t count) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// Position t's row of KV head kh in a cache [S, Hkv, D], prefetching the row kAhead positions on.
struct HeadRows {
    const int32_t* slots;
    int64_t n, S, Hkv, kh, D;

    template <typename T>
    const T* operator()(const T* cache, int64_t t) const {
        if (t + kAhead < n) prefetch(cache + (clamp_slot(slots[t + kAhead], S) * Hkv + kh) * D, D);
        return cache + (clamp_slot(slots[t], S) * Hkv + kh) * D;
    }
};

// Generic path of one (row, KV head) task: scores for the G query heads sharing KV head kh, softmax, and
// the weighted sum of V. `qf` holds the G query rows in float32; `p` is G * n floats of scratch.
template <typename E>
void attend_generic(const float* qf, const typename E::T* k_cache, const typename E::T* v_cache,
                    const int32_t* slots, int64_t n, int64_t S, int64_t Hkv, int64_t kh, int64_t G, int64_t D,
                    float scale, float soft_cap, float* p, float* acc) {
    const HeadRows at{slots, n, S, Hkv, kh, D};
    std::vector<float> row(D);
    for (int64_t t = 0; t < n; ++t) {
        load_row<E>(at(k_cache, t), row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            p[g * n + t] = capped(s * scale, soft_cap);
        }
    }
    softmax_rows(p, G, n);
    for (int64_t t = 0; t < n; ++t) {
        load_row<E>(at(v_cache, t), row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
            const float w = p[g * n + t];
            float* ag = acc + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += w * row[d];
        }
    }
}

#if defined(__AVX512F__)
// r[i] = sum of the 16 floats of rows[i], for 16 rows (a 16 x 16 block): four levels of pairwise
// permute-and-add, 15 adds for 16 sums where a horizontal reduction per row costs ~8 operations each.
inline __m512 sum_rows16(const float* rows) {
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i hi3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i hi4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    auto fold = [](__m512 a, __m512 b, __m512i lo, __m512i hi) {
        return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
    };
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; ++i) l1[i] = fold(_mm512_load_ps(rows + 32 * i), _mm512_load_ps(rows + 32 * i + 16), lo1, hi1);
    for (int i = 0; i < 4; ++i) l2[i] = fold(l1[2 * i], l1[2 * i + 1], lo2, hi2);
    for (int i = 0; i < 2; ++i) l3[i] = fold(l2[2 * i], l2[2 * i + 1], lo3, hi3);
    return fold(l3[0], l3[1], lo4, hi4);
}

// Scores of tb <= 16 positions for gc query heads: block holds, per head (256 floats apart), each
// position's 16-lane products; head g's sums, scaled and soft-capped, go to out + g * n.
inline void block_scores(const float* block, int gc, float* out, int64_t n, int64_t tb, float scale, float soft_cap) {
    const __mmask16 valid = tb == 16 ? 0xFFFF : static_cast<__mmask16>((1u << tb) - 1);
    for (int g = 0; g < gc; ++g) {
        float* o = out + g * n;
        _mm512_mask_storeu_ps(o, valid, _mm512_mul_ps(sum_rows16(block + 256 * g), _mm512_set1_ps(scale)));
        if (soft_cap > 0.0f)
            for (int64_t i = 0; i < tb; ++i) o[i] = capped(o[i], soft_cap);
    }
}

// The same task for KV heads kh0 .. kh0 + nkh - 1, D = 16 * V, one KV head and up to GC of its query heads
// at a time, so that the weighted sum of V stays in GC * V <= 16 registers. Scores come 16 positions at a
// time: each position's 16-lane products go to a block that `sum_rows16` reduces. qf, p and acc hold
// nkh * G query heads; acc is written, not accumulated.
template <typename E, int V>
void attend_avx512(const float* qf, const typename E::T* k_cache, const typename E::T* v_cache,
                   const int32_t* slots, int64_t n, int64_t S, int64_t Hkv, int64_t kh0, int64_t nkh, int64_t G,
                   float scale, float soft_cap, float* p, float* acc) {
    constexpr int64_t D = 16 * V;
    constexpr int GC = V >= 16 ? 1 : 16 / V;
    alignas(64) float block[GC][16 * 16];
    for (int64_t j = 0; j < nkh; ++j) {
        const HeadRows row{slots, n, S, Hkv, kh0 + j, D};
        for (int64_t g0 = 0; g0 < G; g0 += GC) {
            const int gc = static_cast<int>(G - g0 < GC ? G - g0 : GC);
            const int64_t h0 = j * G + g0;
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const int64_t tb = n - t0 < 16 ? n - t0 : 16;
                for (int64_t i = 0; i < tb; ++i) {
                    const typename E::T* kr = row(k_cache, t0 + i);
                    __m512 kv[V];
                    for (int v = 0; v < V; ++v) kv[v] = load16(kr + 16 * v);
#pragma GCC unroll 16
                    for (int g = 0; g < GC; ++g) {
                        if (g >= gc) break;
                        const float* qg = qf + (h0 + g) * D;
                        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
                        for (int v = 1; v < V; ++v) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), kv[v], s);
                        _mm512_store_ps(block[g] + 16 * i, s);
                    }
                }
                block_scores(block[0], gc, p + h0 * n + t0, n, tb, scale, soft_cap);
            }
            softmax_rows(p + h0 * n, gc, n);
            __m512 a[GC][V];
            for (int g = 0; g < GC; ++g)
                for (int v = 0; v < V; ++v) a[g][v] = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; ++t) {
                const typename E::T* vr = row(v_cache, t);
                __m512 vv[V];
                for (int v = 0; v < V; ++v) vv[v] = load16(vr + 16 * v);
#pragma GCC unroll 16
                for (int g = 0; g < GC; ++g) {
                    if (g >= gc) break;
                    const __m512 w = _mm512_set1_ps(p[(h0 + g) * n + t]);
                    for (int v = 0; v < V; ++v) a[g][v] = _mm512_fmadd_ps(w, vv[v], a[g][v]);
                }
            }
            for (int g = 0; g < gc; ++g)
                for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (h0 + g) * D + 16 * v, a[g][v]);
        }
    }
}
#endif

#if defined(__AVX512BF16__)
// Softmax weights p[0:n] as bf16 pairs in place: uint32 i of the row holds weights 2i and 2i + 1 (a zero
// weight after an odd n). Each chunk's bf16 lands on bytes that were already read.
inline const uint32_t* bf16_pairs_in_place(float* p, int64_t n) {
    uint16_t* out = reinterpret_cast<uint16_t*>(p);
    for (int64_t t = 0; t < n; t += 32) {
        const int64_t m = n - t;
        const __mmask16 lo = m >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << m) - 1);
        const __mmask16 hi = m >= 32 ? 0xFFFF : m <= 16 ? 0 : static_cast<__mmask16>((1u << (m - 16)) - 1);
        const __m512 a = _mm512_maskz_loadu_ps(lo, p + t), b = _mm512_maskz_loadu_ps(hi, p + t + 16);
        const __mmask32 both = (static_cast<__mmask32>(hi) << 16) | lo;
        _mm512_mask_storeu_epi16(out + t, both, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    out[n] = 0;
    return reinterpret_cast<const uint32_t*>(out);
}

// The task of `attend_avx512` for bf16 caches on AVX512-BF16 pairs (vdpbf16ps), D = 32 * W: scores are
// bf16 q . bf16 k with float32 sums; the weighted sum of V takes two positions per instruction, with
// the weights rounded to bf16 as torch's bf16 attention does. Half the instructions of the float path.
// qb holds the task's nkh * G query heads in bf16.
template <int W>
void attend_bf16_pairs(const uint16_t* qb, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* slots,
                       int64_t n, int64_t S, int64_t Hkv, int64_t kh0, int64_t nkh, int64_t G, float scale,
                       float soft_cap, float* p, float* acc) {
    constexpr int64_t D = 32 * W;
    constexpr int GC = 8 / W;  // query heads per pass: 2 * GC * W = 16 accumulators
    alignas(64) float block[GC][16 * 16];
    // V rows t and t + 1 interleaved put d = 32w + 8L + i (128-bit lane L, i < 4) in lane 4L + i of the low
    // sums and d + 4 in the high ones: these put them back in order.
    const __m512i order0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i order1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t j = 0; j < nkh; ++j) {
        const HeadRows row{slots, n, S, Hkv, kh0 + j, D};
        for (int64_t g0 = 0; g0 < G; g0 += GC) {
            const int gc = static_cast<int>(G - g0 < GC ? G - g0 : GC);
            const int64_t h0 = j * G + g0;
            __m512bh qv[GC][W];
            for (int g = 0; g < gc; ++g)
                for (int w = 0; w < W; ++w) qv[g][w] = (__m512bh)_mm512_loadu_si512(qb + (h0 + g) * D + 32 * w);
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const int64_t tb = n - t0 < 16 ? n - t0 : 16;
                for (int64_t i = 0; i < tb; ++i) {
                    const uint16_t* kr = row(k_cache, t0 + i);
                    __m512bh kv[W];
                    for (int w = 0; w < W; ++w) kv[w] = (__m512bh)_mm512_loadu_si512(kr + 32 * w);
#pragma GCC unroll 8
                    for (int g = 0; g < GC; ++g) {
                        if (g >= gc) break;
                        __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
                        for (int w = 1; w < W; ++w) s = _mm512_dpbf16_ps(s, qv[g][w], kv[w]);
                        _mm512_store_ps(block[g] + 16 * i, s);
                    }
                }
                block_scores(block[0], gc, p + h0 * n + t0, n, tb, scale, soft_cap);
            }
            softmax_rows(p + h0 * n, gc, n);
            const uint32_t* weights[GC];
            for (int g = 0; g < gc; ++g) weights[g] = bf16_pairs_in_place(p + (h0 + g) * n, n);
            __m512 lo[GC][W], hi[GC][W];
            for (int g = 0; g < GC; ++g)
                for (int w = 0; w < W; ++w) lo[g][w] = hi[g][w] = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 2) {
                const uint16_t* a = row(v_cache, t);
                const uint16_t* b = t + 1 < n ? row(v_cache, t + 1) : nullptr;
                __m512bh ul[W], uh[W];
                for (int w = 0; w < W; ++w) {
                    const __m512i av = _mm512_loadu_si512(a + 32 * w);
                    const __m512i bv = b ? _mm512_loadu_si512(b + 32 * w) : _mm512_setzero_si512();
                    ul[w] = (__m512bh)_mm512_unpacklo_epi16(av, bv);
                    uh[w] = (__m512bh)_mm512_unpackhi_epi16(av, bv);
                }
#pragma GCC unroll 8
                for (int g = 0; g < GC; ++g) {
                    if (g >= gc) break;
                    const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[g][t / 2]));
                    for (int w = 0; w < W; ++w) {
                        lo[g][w] = _mm512_dpbf16_ps(lo[g][w], wv, ul[w]);
                        hi[g][w] = _mm512_dpbf16_ps(hi[g][w], wv, uh[w]);
                    }
                }
            }
            for (int g = 0; g < gc; ++g)
                for (int w = 0; w < W; ++w) {
                    float* out = acc + (h0 + g) * D + 32 * w;
                    _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo[g][w], order0, hi[g][w]));
                    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo[g][w], order1, hi[g][w]));
                }
        }
    }
}
#endif

// One query per row b (`q_stride` elements after row b - 1), attending to the first seq_lens[b] slots of page-table
// row rows_req[b] (b itself when rows_req is null); the G = H / Hkv query heads of a KV head share each K / V
// row read. A task is a whole row (all heads: sequential reads) when there are enough rows for every thread,
// else one (row, KV head) pair. Each (row, head) result is one fixed computation over its own query, keys and
// values, whatever the other rows and the task split: the kernel is batch-invariant, so deterministic mode
// runs an extend through it too, one row per query token (torch_ops.cpp).
template <typename E>
void decode_attention(const typename E::T* q, int64_t q_stride, const typename E::T* k_cache,
                      const typename E::T* v_cache, const int32_t* table, int64_t table_stride, const int32_t* rows_req,
                      const int32_t* seq_lens, typename E::T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                      int64_t S, float scale, int64_t window, float soft_cap) {
    const int64_t G = H / Hkv;
    const int64_t nkh = B >= 2 * omp_get_max_threads() ? Hkv : 1;  // KV heads per task
    const int64_t tasks_per_row = Hkv / nkh;
    const int64_t heads = nkh * G;
#pragma omp parallel
    {
        thread_local std::vector<float> qf, acc, p;  // kept between calls
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * tasks_per_row; ++task) {
            const int64_t b = task / tasks_per_row, kh0 = (task % tasks_per_row) * nkh;
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len > 0 ? len - start : 0;
            typename E::T* o = out + (b * H + kh0 * G) * D;
            const typename E::T* qrow = q + b * q_stride + kh0 * G * D;
            qf.resize(heads * D);
            acc.assign(heads * D, 0.0f);
            p.resize(heads * n);
            if (n > 0) {
                load_row<E>(qrow, qf.data(), heads * D);
                const int32_t* slots = table + (rows_req ? rows_req[b] : b) * table_stride + start;
                bool done = false;
#if defined(__AVX512BF16__)
                if constexpr (std::is_same_v<E, BF16>) {
                    const uint16_t* qb = qrow;
                    done = true;
                    switch (D) {
                        case 32: attend_bf16_pairs<1>(qb, k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 64: attend_bf16_pairs<2>(qb, k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 128: attend_bf16_pairs<4>(qb, k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 256: attend_bf16_pairs<8>(qb, k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        default: done = false;
                    }
                }
#endif
#if defined(__AVX512F__)
                if (!done) {
                    done = true;
                    switch (D) {
                        case 32: attend_avx512<E, 2>(qf.data(), k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 64: attend_avx512<E, 4>(qf.data(), k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 128: attend_avx512<E, 8>(qf.data(), k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        case 256: attend_avx512<E, 16>(qf.data(), k_cache, v_cache, slots, n, S, Hkv, kh0, nkh, G, scale, soft_cap, p.data(), acc.data()); break;
                        default: done = false;
                    }
                }
#endif
                if (!done)
                    for (int64_t j = 0; j < nkh; ++j)
                        attend_generic<E>(qf.data() + j * G * D, k_cache, v_cache, slots, n, S, Hkv, kh0 + j, G, D, scale,
                                          soft_cap, p.data() + j * G * n, acc.data() + j * G * D);
            }
            for (int64_t i = 0; i < heads * D; ++i) o[i] = E::store(acc[i]);  // zeros for an empty row
        }
    }
}

// Scatter T token rows of `row` elements (k / v token strides in elements) into the caches; slots < 0
// are skipped. Returns how many slots are >= S, and then writes nothing.
int64_t store_kv(char* k_cache, char* v_cache, const char* k, const char* v, int64_t k_stride, int64_t v_stride,
                 const int64_t* slots, int64_t T, int64_t row, int64_t elem, int64_t S) {
    int64_t bad = 0;
    for (int64_t t = 0; t < T; ++t) bad += slots[t] >= S;
    if (bad) return bad;
    const int64_t bytes = row * elem;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        std::memcpy(k_cache + slot * bytes, k + t * k_stride * elem, bytes);
        std::memcpy(v_cache + slot * bytes, v + t * v_stride * elem, bytes);
    }
    return 0;
}

}  // namespace

extern "C" {

int ce_decode_attention(int dt, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                        const int32_t* table, int64_t table_stride, const int32_t* rows_req, const int32_t* seq_lens,
                        void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S, float scale, int64_t window,
                        float soft_cap) {
#define CE_DECODE(E)                                                                                               \
    decode_attention<E>(static_cast<const E::T*>(q), q_stride, static_cast<const E::T*>(k_cache),                  \
                        static_cast<const E::T*>(v_cache), table, table_stride, rows_req, seq_lens,                \
                        static_cast<E::T*>(out), B, H, Hkv, D, S, scale, window, soft_cap)
    switch (dt) {
        case 0: CE_DECODE(F32); return 0;
        case 1: CE_DECODE(BF16); return 0;
        case 2: CE_DECODE(F16); return 0;
        default: return -1;
    }
#undef CE_DECODE
}

int64_t ce_store_kv(void* k_cache, void* v_cache, const void* k, const void* v, int64_t k_stride, int64_t v_stride,
                    const int64_t* slots, int64_t T, int64_t row, int64_t elem, int64_t S) {
    return store_kv(static_cast<char*>(k_cache), static_cast<char*>(v_cache), static_cast<const char*>(k),
                    static_cast<const char*>(v), k_stride, v_stride, slots, T, row, elem, S);
}

}  // extern "C"
