// The packed linear: out = x @ W.T (+ bias) with W kept in its block-quantized format (kernels/packed.py has
// the formats; the layouts are llama.cpp's). The kernel behind kernels::linear_packed for bf16 activations
// on a weight in the file's own layout (torch_ops.cpp): one whose rows were not interleaved at load (not a
// multiple of 16, or loaded without kernels.init); interleaved formats go to packed_linear_x16.cpp.
//
// Each row of x is quantized to int16 in blocks of 32 with one fp32 scale per block (max |x| / 32767): row by
// row, so a row's values never depend on the other rows, and 16 bits keep the rounding far below bf16's
// (llama.cpp's dot quantizes activations to int8, whose rounding shows in the log-probs: docs/benchmarks.md).
// A weight block's sub-blocks of 32 are unpacked to int16 in registers; each sub-block's integer dot with the
// activations' block (pairs summed to int32, with Q6_K's per-16 integer scales folded into the weights) is
// converted to float and accumulated with one FMA by (weight scale x activation scale), in eight float lanes,
// in order over k; offsets and mins (w = d q + m) add one FMA by the activations' block sum. Every output
// element is that same instruction sequence whatever M, the tile it falls in or the thread count: the kernel
// is batch-invariant by construction.

#include "packed_acts.h"

namespace {

enum Format { Q8_0 = 0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, I8, I4 };
constexpr int kInterleaved = 16;  // format codes from here on: a base format's 16 rows interleaved (its code + 16)

// Q4_K / Q5_K: sub-block j's six-bit scale and min (llama.cpp's get_scale_min_k4).
inline void k_scale_min(const uint8_t* sc, int j, int& s, int& m) {
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// One sub-block of 32 weights, unpacked: q[i] the quants (0..63 for unsigned formats, -128..127 for signed
// ones), the integer scale of weights 0-15 and 16-31 (1 but for Q6_K), a the float multiplier of the
// integer dot, b that of the activations' sum (0 for formats without offset or min).
struct SubBlock {
    float a, b;
    int16_t s_lo, s_hi;
};

// Format traits: block size, bytes, sub-blocks, signedness; sub(p, j) the scalars of sub-block j of the
// block at p; quants(p, j, out) its 32 quants (the scalar path; the AVX2 path has its own unpacking below).
template <int F>
struct Fmt;

template <>
struct Fmt<Q8_0> {
    static constexpr int block = 32, bytes = 34, subs = 1;
    static constexpr bool is_signed = true;
    static SubBlock sub(const uint8_t* p, int) { return {f16_at(p), 0.0f, 1, 1}; }
    static void quants(const uint8_t* p, int, int8_t* q) { std::memcpy(q, p + 2, 32); }
};
template <>
struct Fmt<I8> : Fmt<Q8_0> {
    static SubBlock sub(const uint8_t* p, int) { return {bf16_at(p), 0.0f, 1, 1}; }
};

inline void nibbles(const uint8_t* qs, int8_t* q) {
    for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<int8_t>(qs[i] & 0xF);
        q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
    }
}
inline void high_bits(const uint8_t* qh, int8_t* q) {  // bit i of the 32-bit little-endian qh -> +16
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q[i] | (((qh[i / 8] >> (i % 8)) & 1) << 4));
}

template <>
struct Fmt<Q4_0> {
    static constexpr int block = 32, bytes = 18, subs = 1, qs_at = 2;
    static constexpr bool is_signed = false;
    static SubBlock sub(const uint8_t* p, int) {
        const float d = f16_at(p);
        return {d, -8.0f * d, 1, 1};
    }
    static void quants(const uint8_t* p, int, int8_t* q) { nibbles(p + 2, q); }
};
template <>
struct Fmt<I4> : Fmt<Q4_0> {
    static SubBlock sub(const uint8_t* p, int) {
        const float d = bf16_at(p);
        return {d, -8.0f * d, 1, 1};
    }
};
template <>
struct Fmt<Q4_1> {
    static constexpr int block = 32, bytes = 20, subs = 1, qs_at = 4;
    static constexpr bool is_signed = false;
    static SubBlock sub(const uint8_t* p, int) { return {f16_at(p), f16_at(p + 2), 1, 1}; }
    static void quants(const uint8_t* p, int, int8_t* q) { nibbles(p + 4, q); }
};
template <>
struct Fmt<Q5_0> {
    static constexpr int block = 32, bytes = 22, subs = 1, qh_at = 2, qs_at = 6;
    static constexpr bool is_signed = false;
    static SubBlock sub(const uint8_t* p, int) {
        const float d = f16_at(p);
        return {d, -16.0f * d, 1, 1};
    }
    static void quants(const uint8_t* p, int, int8_t* q) {
        nibbles(p + 6, q);
        high_bits(p + 2, q);
    }
};
template <>
struct Fmt<Q5_1> {
    static constexpr int block = 32, bytes = 24, subs = 1, qh_at = 4, qs_at = 8;
    static constexpr bool is_signed = false;
    static SubBlock sub(const uint8_t* p, int) { return {f16_at(p), f16_at(p + 2), 1, 1}; }
    static void quants(const uint8_t* p, int, int8_t* q) {
        nibbles(p + 8, q);
        high_bits(p + 4, q);
    }
};

// Q4_K, Q5_K: sub-block j takes chunk j/2's low (even j) or high (odd j) nibbles (and, Q5_K, bit j of each
// high-bit byte); w = (d s_j) q - (dmin m_j).
template <int QsAt, int QhAt>
struct KQuant {
    static constexpr int block = 256, subs = 8, qs_at = QsAt, qh_at = QhAt;
    static constexpr bool is_signed = false;
    static SubBlock sub(const uint8_t* p, int j) {
        int s, m;
        k_scale_min(p + 4, j, s, m);
        return {f16_at(p) * static_cast<float>(s), -(f16_at(p + 2) * static_cast<float>(m)), 1, 1};
    }
    static void quants(const uint8_t* p, int j, int8_t* q) {
        const uint8_t* qs = p + QsAt + 32 * (j / 2);
        for (int i = 0; i < 32; ++i) {
            int v = j % 2 ? qs[i] >> 4 : qs[i] & 0xF;
            if constexpr (QhAt >= 0) v |= ((p[QhAt + i] >> j) & 1) << 4;
            q[i] = static_cast<int8_t>(v);
        }
    }
};
template <>
struct Fmt<Q4_K> : KQuant<16, -1> {
    static constexpr int bytes = 144;
};
template <>
struct Fmt<Q5_K> : KQuant<48, 16> {
    static constexpr int bytes = 176;
};

// Q6_K: per 128-half n, group g = 0..3 of 32 (sub-block j = 4n + g) takes ql[64n + 32(g&1) + i]'s low (g < 2)
// or high nibble and bits 2g, 2g+1 of qh[32n + i]; w = d s (q - 32) with an int8 scale per 16 weights.
template <>
struct Fmt<Q6_K> {
    static constexpr int block = 256, bytes = 210, subs = 8;
    static constexpr bool is_signed = true;
    static SubBlock sub(const uint8_t* p, int j) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * (j / 4) + 2 * (j % 4);
        return {f16_at(p + 208), 0.0f, sc[0], sc[1]};
    }
    static void quants(const uint8_t* p, int j, int8_t* q) {
        const int n = j / 4, g = j % 4;
        const uint8_t* ql = p + 64 * n + 32 * (g & 1);
        const uint8_t* qh = p + 128 + 32 * n;
        for (int i = 0; i < 32; ++i) {
            const int low = g < 2 ? ql[i] & 0xF : ql[i] >> 4;
            q[i] = static_cast<int8_t>((low | (((qh[i] >> (2 * g)) & 3) << 4)) - 32);
        }
    }
};

#if defined(CE_PACKED_AVX2)
inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_hadd_ps(x, x);
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(x);
}

// 16 bytes of nibbles -> 32 bytes: low nibbles (weights 0-15), then high (16-31).
inline __m256i unpack_nibbles(const uint8_t* qs) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// The 32 bits at qh (little endian) -> byte i = 0x10 where bit i is set.
inline __m256i unpack_high_bits(const uint8_t* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// Sub-block j's 32 quants in a register (the same values as Fmt<F>::quants).
template <int F>
inline __m256i quants_avx2(const uint8_t* p, int j) {
    using T = Fmt<F>;
    if constexpr (F == Q8_0 || F == I8) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    } else if constexpr (F == Q4_0 || F == I4 || F == Q4_1) {
        return unpack_nibbles(p + T::qs_at);
    } else if constexpr (F == Q5_0 || F == Q5_1) {
        return _mm256_or_si256(unpack_nibbles(p + T::qs_at), unpack_high_bits(p + T::qh_at));
    } else if constexpr (F == Q4_K || F == Q5_K) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + T::qs_at + 32 * (j / 2)));
        const __m256i m = _mm256_set1_epi8(0x0F);
        __m256i q = j % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m) : _mm256_and_si256(v, m);
        if constexpr (F == Q5_K) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + T::qh_at));
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        return q;
    } else {  // Q6_K
        const int n = j / 4, g = j % 4;
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * n + 32 * (g & 1)));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * n));
        const __m256i m = _mm256_set1_epi8(0x0F);
        const __m256i low = g < 2 ? _mm256_and_si256(l, m) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    }
}
#endif

// Rows r0 .. r0+R-1 of the activations against one weight row w (nblocks blocks): out[r] = the dots.
template <int F, int R>
inline void dot_rows(const uint8_t* w, int64_t nblocks, const Acts& x, int64_t r0, float* out) {
    using T = Fmt<F>;
#if defined(CE_PACKED_AVX2)
    __m256 acc[R];
    float acc_b[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
        acc_b[r] = 0.0f;
    }
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint8_t* p = w + blk * T::bytes;
        for (int j = 0; j < T::subs; ++j) {
            const int64_t xb = blk * T::subs + j;
            const SubBlock sb = T::sub(p, j);
            const __m256i q = quants_avx2<F>(p, j);
            const __m128i q_lo = _mm256_castsi256_si128(q), q_hi = _mm256_extracti128_si256(q, 1);
            __m256i w_lo = T::is_signed ? _mm256_cvtepi8_epi16(q_lo) : _mm256_cvtepu8_epi16(q_lo);
            __m256i w_hi = T::is_signed ? _mm256_cvtepi8_epi16(q_hi) : _mm256_cvtepu8_epi16(q_hi);
            if constexpr (F == Q6_K) {  // |q s| <= 32 * 128: still an int16
                w_lo = _mm256_mullo_epi16(w_lo, _mm256_set1_epi16(sb.s_lo));
                w_hi = _mm256_mullo_epi16(w_hi, _mm256_set1_epi16(sb.s_hi));
            }
            for (int r = 0; r < R; ++r) {
                const int64_t row = r0 + r;
                const int16_t* a = x.q.data() + row * x.K + 32 * xb;
                const __m256i dot = _mm256_add_epi32(
                    _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                    _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16))));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sb.a * x.d[row * x.nb + xb]), acc[r]);
                if (!T::is_signed) acc_b[r] = std::fma(sb.b, x.s[row * x.nb + xb], acc_b[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + acc_b[r];
#else
    float acc[R] = {}, acc_b[R] = {};
    int8_t q[32];
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint8_t* p = w + blk * T::bytes;
        for (int j = 0; j < T::subs; ++j) {
            const int64_t xb = blk * T::subs + j;
            const SubBlock sb = T::sub(p, j);
            T::quants(p, j, q);
            for (int r = 0; r < R; ++r) {
                const int64_t row = r0 + r;
                const int16_t* a = x.q.data() + row * x.K + 32 * xb;
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 16; ++i) lo += q[i] * a[i];
                for (int i = 16; i < 32; ++i) hi += q[i] * a[i];
                const float dot = static_cast<float>(lo * sb.s_lo + hi * sb.s_hi);
                acc[r] = std::fma(dot, sb.a * x.d[row * x.nb + xb], acc[r]);
                if (!T::is_signed) acc_b[r] = std::fma(sb.b, x.s[row * x.nb + xb], acc_b[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r] + acc_b[r];
#endif
}


template <int F, typename E>
void packed_linear(const typename E::T* x, const uint8_t* w, const float* bias, typename E::T* out, int64_t M,
                   int64_t N, int64_t K) {
    using T = Fmt<F>;
    const Acts a = quantize_rows<E>(x, M, K);
    const int64_t nblocks = K / T::block, row_bytes = nblocks * T::bytes;
    constexpr int64_t kRowsPerTask = 16;  // weight rows per task: their blocks stay in cache across x's tiles
    const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n_end = std::min(N, (t + 1) * kRowsPerTask);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t rows = std::min<int64_t>(4, M - m0);
            for (int64_t n = t * kRowsPerTask; n < n_end; ++n) {
                float dots[4];
                const uint8_t* wr = w + n * row_bytes;
                switch (rows) {
                    case 4: dot_rows<F, 4>(wr, nblocks, a, m0, dots); break;
                    case 3: dot_rows<F, 3>(wr, nblocks, a, m0, dots); break;
                    case 2: dot_rows<F, 2>(wr, nblocks, a, m0, dots); break;
                    default: dot_rows<F, 1>(wr, nblocks, a, m0, dots); break;
                }
                for (int64_t r = 0; r < rows; ++r)
                    out[(m0 + r) * N + n] = E::store(bias ? dots[r] + bias[n] : dots[r]);
            }
        }
    }
}

template <typename E>
int dispatch(int format, const void* x, const uint8_t* w, const float* bias, void* out, int64_t M, int64_t N,
             int64_t K) {
    using X = const typename E::T*;
    auto* o = static_cast<typename E::T*>(out);
    switch (format) {
        case Q8_0: packed_linear<Q8_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q4_0: packed_linear<Q4_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q4_1: packed_linear<Q4_1, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q5_0: packed_linear<Q5_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q5_1: packed_linear<Q5_1, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q4_K: packed_linear<Q4_K, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q5_K: packed_linear<Q5_K, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case Q6_K: packed_linear<Q6_K, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case I8: packed_linear<I8, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case I4: packed_linear<I4, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        default: return -1;
    }
}

}  // namespace

extern "C" {
int ce_packed_linear_x16(int base, int x_dt, const void* x, const uint8_t* w, const float* bias, void* out,
                         int64_t M, int64_t N, int64_t K);

// x [M, K] (x_dt: 0 float32, 1 bfloat16; K a multiple of 32), w [N] rows of `format`'s blocks, bias [N]
// float32 or null, out [M, N] in x's dtype. Returns 0, or -1 for a format or dtype it does not know.
int ce_packed_linear(int format, int x_dt, const void* x, const uint8_t* w, const float* bias, void* out, int64_t M,
                     int64_t N, int64_t K) {
    if (format >= kInterleaved) return ce_packed_linear_x16(format - kInterleaved, x_dt, x, w, bias, out, M, N, K);
    if (x_dt == 0) return dispatch<F32>(format, x, w, bias, out, M, N, K);
    if (x_dt == 1) return dispatch<BF16>(format, x, w, bias, out, M, N, K);
    return -1;
}
}
