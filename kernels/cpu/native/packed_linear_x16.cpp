// The packed linear on 16 rows interleaved (kernels/interleave.py has the layout): out = x @ W.T (+ bias) for
// weights whose N rows were regrouped at load, 16 rows a group: each block holds the 16 rows' scale fields side
// by side, then their high-bit masks, then their quants ordered so that one load widened to 16-bit words holds
// one pair of neighbouring columns for each of the 16 rows. Nothing is re-quantized: every weight keeps its
// file's bits (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and --quantization's I8, I4).
//
// The activations are quantized as in packed_linear.cpp (int16 per row and block of 32, packed_acts.h). Each
// lane of a vector is one output column (one weight row): the pair products of a sub-block of 32 columns are
// summed exactly in int32 (VNNI's vpdpwssd, AVX512 or AVX-VNNI, or vpmaddwd + vpaddd), converted to float once and accumulated with
// one FMA by (weight scale x activation scale) (Q6_K: one per half of 16, each with its own scale), then the
// offset (a min, or -8 d / -16 d) with one FMA by the activations' block sum, in order over the blocks. That is
// the same sequence of float operations in every lane, tile and thread, and in the AVX512, AVX2 and scalar
// code: the kernel is batch-invariant, and its three paths give the same bits.

#include "packed_acts.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CE_X16_AVX512 1
#elif defined(CE_PACKED_AVX2) && defined(__F16C__)
#define CE_X16_AVX2 1
#endif

namespace {

constexpr int kRows = 16;  // weight rows per group: one per lane of a 512-bit float vector

inline uint32_t u32_at(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// ---- vector widths: the same operations on W lanes (lanes lane0 .. lane0 + W - 1 of a group) ---------------
// Words: the 16-bit quants of a chunk (two per lane); Int: 32-bit lanes; Float: float lanes.

#if defined(CE_X16_AVX512)
struct Lanes {
    static constexpr int W = 16;
    using Words = __m512i;
    using Int = __m512i;
    using Float = __m512;
    static Words u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
    static Words i8(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
    static Words low4(Words z) { return _mm512_and_si512(z, _mm512_set1_epi16(0x0F)); }
    static Words high4(Words z) { return _mm512_srli_epi16(z, 4); }
    static Words add_where(Words w, uint32_t bits, int v) {
        return _mm512_mask_add_epi16(w, bits, w, _mm512_set1_epi16(static_cast<int16_t>(v)));
    }
    static Words sub(Words w, int v) { return _mm512_sub_epi16(w, _mm512_set1_epi16(static_cast<int16_t>(v))); }
    static Int zero() { return _mm512_setzero_si512(); }
    static Int dot(Int acc, Words w, int32_t pair) {
#if defined(__AVX512VNNI__)
        return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(pair));
#else
        return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(pair)));
#endif
    }
    static Int add(Int a, Int b) { return _mm512_add_epi32(a, b); }
    static Int u8_int(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static Int i8_int(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static Int and_(Int a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
    static Int or_(Int a, Int b) { return _mm512_or_si512(a, b); }
    static Int shr(Int a, int n) { return _mm512_srli_epi32(a, n); }
    static Int shl(Int a, int n) { return _mm512_slli_epi32(a, n); }
    static Float to_float(Int a) { return _mm512_cvtepi32_ps(a); }
    static Float f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static Float bf16(const uint8_t* p) { return load16_bf16(_mm256_loadu_si256((const __m256i*)p)); }
    static Float fzero() { return _mm512_setzero_ps(); }
    static Float set(float v) { return _mm512_set1_ps(v); }
    static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
    static Float neg(Float a) {
        return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
    }
    static Float fma(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
    static void store(float* out, Float v) { _mm512_storeu_ps(out, v); }
};
#elif defined(CE_X16_AVX2)
struct Lanes {
    static constexpr int W = 8;
    using Words = __m256i;
    using Int = __m256i;
    using Float = __m256;
    static Words u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
    static Words i8(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
    static Words low4(Words z) { return _mm256_and_si256(z, _mm256_set1_epi16(0x0F)); }
    static Words high4(Words z) { return _mm256_srli_epi16(z, 4); }
    static Words add_where(Words w, uint32_t bits, int v) {  // the low 16 bits: one per word
        const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                              16384, static_cast<int16_t>(0x8000));
        const __m256i set =
            _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), bit), bit);
        return _mm256_add_epi16(w, _mm256_and_si256(set, _mm256_set1_epi16(static_cast<int16_t>(v))));
    }
    static Words sub(Words w, int v) { return _mm256_sub_epi16(w, _mm256_set1_epi16(static_cast<int16_t>(v))); }
    static Int zero() { return _mm256_setzero_si256(); }
    static Int dot(Int acc, Words w, int32_t pair) {
#if defined(__AVXVNNI__)
        return _mm256_dpwssd_avx_epi32(acc, w, _mm256_set1_epi32(pair));
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
#endif
    }
    static Int add(Int a, Int b) { return _mm256_add_epi32(a, b); }
    static Int u8_int(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    static Int i8_int(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    static Int and_(Int a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
    static Int or_(Int a, Int b) { return _mm256_or_si256(a, b); }
    static Int shr(Int a, int n) { return _mm256_srli_epi32(a, n); }
    static Int shl(Int a, int n) { return _mm256_slli_epi32(a, n); }
    static Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
    static Float f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static Float bf16(const uint8_t* p) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    }
    static Float fzero() { return _mm256_setzero_ps(); }
    static Float set(float v) { return _mm256_set1_ps(v); }
    static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
    static Float neg(Float a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
    static Float fma(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
    static void store(float* out, Float v) { _mm256_storeu_ps(out, v); }
};
#else
struct Lanes {  // one lane: the portable C++
    static constexpr int W = 1;
    struct Words {
        int32_t a, b;  // the lane's two quants
    };
    using Int = int32_t;
    using Float = float;
    static Words u8(const uint8_t* p) { return {p[0], p[1]}; }
    static Words i8(const uint8_t* p) { return {static_cast<int8_t>(p[0]), static_cast<int8_t>(p[1])}; }
    static Words low4(Words z) { return {z.a & 0xF, z.b & 0xF}; }
    static Words high4(Words z) { return {z.a >> 4, z.b >> 4}; }
    static Words add_where(Words w, uint32_t bits, int v) {
        return {w.a + (bits & 1 ? v : 0), w.b + (bits & 2 ? v : 0)};
    }
    static Words sub(Words w, int v) { return {w.a - v, w.b - v}; }
    static Int zero() { return 0; }
    static Int dot(Int acc, Words w, int32_t pair) {
        return acc + w.a * static_cast<int16_t>(pair & 0xFFFF) + w.b * static_cast<int16_t>(pair >> 16);
    }
    static Int add(Int a, Int b) { return a + b; }
    static Int u8_int(const uint8_t* p) { return p[0]; }
    static Int i8_int(const uint8_t* p) { return static_cast<int8_t>(p[0]); }
    static Int and_(Int a, int m) { return a & m; }
    static Int or_(Int a, Int b) { return a | b; }
    static Int shr(Int a, int n) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> n); }
    static Int shl(Int a, int n) { return a << n; }
    static Float to_float(Int a) { return static_cast<float>(a); }
    static Float f16(const uint8_t* p) { return f16_at(p); }
    static Float bf16(const uint8_t* p) { return bf16_at(p); }
    static Float fzero() { return 0.0f; }
    static Float set(float v) { return v; }
    static Float mul(Float a, Float b) { return a * b; }
    static Float neg(Float a) { return -a; }
    static Float fma(Float a, Float b, Float c) { return std::fma(a, b, c); }
    static void store(float* out, Float v) { *out = v; }
};
#endif
using V = Lanes;

// ---- formats: where a block's parts lie, its quants as words, its scales -----------------------------------

// The scales of a sub-block of 32: a0 (a1 for the second 16 where `halves`) multiplies the integer dot, b the
// activations' block sum.
struct Scales {
    V::Float a0, a1, b;
};

// Blocks of 32: `fields` fp16 (bf16) scalars per row (d, then Q4_1 / Q5_1's m), Bits 4, 5 or 8; Offset: 0
// none, 1 the field m (w = d q + m), or a negative multiplier of d (-8: w = d (q - 8)).
template <int Bits, bool Bf16, int Offset>
struct Legacy {
    static constexpr int subs = 1, fields = Offset == 1 ? 2 : 1;
    static constexpr bool halves = false, has_offset = Offset != 0;
    static constexpr int masks = 2 * kRows * fields;
    static constexpr int quants = masks + (Bits == 5 ? 64 : 0);
    static constexpr int block_bytes = quants + (Bits == 8 ? 512 : 256);
    static V::Float field(const uint8_t* p) { return Bf16 ? V::bf16(p) : V::f16(p); }
    // chunk t's two word vectors (pairs 2t and 2t + 1) of lanes lane0..
    static void words(const uint8_t* p, int, int t, int lane0, V::Words& w0, V::Words& w1) {
        if constexpr (Bits == 8) {
            w0 = V::i8(p + quants + 64 * t + 2 * lane0);
            w1 = V::i8(p + quants + 64 * t + 32 + 2 * lane0);
        } else {
            const V::Words z = V::u8(p + quants + 32 * t + 2 * lane0);
            w0 = V::low4(z);
            w1 = V::high4(z);
            if constexpr (Bits == 5) {
                w0 = V::add_where(w0, u32_at(p + masks + 8 * t) >> (2 * lane0), 16);
                w1 = V::add_where(w1, u32_at(p + masks + 8 * t + 4) >> (2 * lane0), 16);
            }
        }
    }
    static Scales scales(const uint8_t* p, int, int lane0) {
        const V::Float d = field(p + 2 * lane0);
        V::Float b = V::fzero();
        if constexpr (Offset == 1) b = field(p + 2 * kRows + 2 * lane0);
        if constexpr (Offset < 0) b = V::mul(d, V::set(static_cast<float>(Offset)));
        return {d, d, b};
    }
};

// Q4_K / Q5_K, blocks of 256 (8 sub-blocks of 32): d, dmin; 12 bytes of six-bit scales s_j and mins m_j
// (llama.cpp's get_scale_min_k4); Q5_K's fifth bits; nibbles. w = (d s_j) q - (dmin m_j).
template <bool Fifth>
struct KQuant {
    static constexpr int subs = 8;
    static constexpr bool halves = false, has_offset = true;
    static constexpr int bytes = 4 * kRows, masks = bytes + 12 * kRows;
    static constexpr int quants = masks + (Fifth ? 8 * 64 : 0);
    static constexpr int block_bytes = quants + 8 * 256;
    static void words(const uint8_t* p, int s, int t, int lane0, V::Words& w0, V::Words& w1) {
        const V::Words z = V::u8(p + quants + 256 * s + 32 * t + 2 * lane0);
        w0 = V::low4(z);
        w1 = V::high4(z);
        if constexpr (Fifth) {
            w0 = V::add_where(w0, u32_at(p + masks + 64 * s + 8 * t) >> (2 * lane0), 16);
            w1 = V::add_where(w1, u32_at(p + masks + 64 * s + 8 * t + 4) >> (2 * lane0), 16);
        }
    }
    static V::Int byte(const uint8_t* p, int i, int lane0) { return V::u8_int(p + bytes + kRows * i + lane0); }
    static Scales scales(const uint8_t* p, int j, int lane0) {
        V::Int s, m;
        if (j < 4) {
            s = V::and_(byte(p, j, lane0), 63);
            m = V::and_(byte(p, j + 4, lane0), 63);
        } else {
            const V::Int hi = byte(p, j + 4, lane0);
            s = V::or_(V::and_(hi, 0xF), V::shl(V::shr(byte(p, j - 4, lane0), 6), 4));
            m = V::or_(V::shr(hi, 4), V::shl(V::shr(byte(p, j, lane0), 6), 4));
        }
        const V::Float a = V::mul(V::f16(p + 2 * lane0), V::to_float(s));
        return {a, a, V::neg(V::mul(V::f16(p + 2 * kRows + 2 * lane0), V::to_float(m)))};
    }
};

// Q6_K, blocks of 256: fp16 d, 16 int8 scales (one per 16 weights), bits 4 and 5 as two mask planes per
// sub-block, the low nibbles. w = d s (q - 32).
struct Q6K {
    static constexpr int subs = 8;
    static constexpr bool halves = true, has_offset = false;
    static constexpr int bytes = 2 * kRows, masks = bytes + 16 * kRows;
    static constexpr int quants = masks + 8 * 128;
    static constexpr int block_bytes = quants + 8 * 256;
    static void words(const uint8_t* p, int s, int t, int lane0, V::Words& w0, V::Words& w1) {
        const V::Words z = V::u8(p + quants + 256 * s + 32 * t + 2 * lane0);
        const uint8_t* m = p + masks + 128 * s + 8 * t;
        w0 = V::sub(V::add_where(V::add_where(V::low4(z), u32_at(m) >> (2 * lane0), 16),
                                 u32_at(m + 64) >> (2 * lane0), 32), 32);
        w1 = V::sub(V::add_where(V::add_where(V::high4(z), u32_at(m + 4) >> (2 * lane0), 16),
                                 u32_at(m + 68) >> (2 * lane0), 32), 32);
    }
    static Scales scales(const uint8_t* p, int j, int lane0) {
        const V::Float d = V::f16(p + 2 * lane0);
        return {V::mul(d, V::to_float(V::i8_int(p + bytes + kRows * (2 * j) + lane0))),
                V::mul(d, V::to_float(V::i8_int(p + bytes + kRows * (2 * j + 1) + lane0))), V::fzero()};
    }
};

constexpr int kTile = 4;  // activation rows per tile, at most

// The activation rows of a tile: row r's quants, scales and scaled sums.
struct TileRows {
    const int16_t* q[kTile];
    const float* d[kTile];
    const float* s[kTile];
};

// Lanes lane0.. of one group's output columns for R rows of x (K / 32 sub-blocks): out[r * 16 + lane].
template <class L, int R>
inline void lanes_tile(const uint8_t* g, int64_t nsub, const TileRows& x, int lane0, float* out) {
    V::Float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::fzero();
    for (int64_t j = 0; j < nsub; ++j) {
        const uint8_t* p = g + (j / L::subs) * L::block_bytes;
        const int s = static_cast<int>(j % L::subs);
        // two integer chains per row: even and odd pairs (their sum is the dot), or (halves) the first and
        // second 16 columns
        V::Int ia[R], ib[R];
        for (int r = 0; r < R; ++r) ia[r] = ib[r] = V::zero();
        for (int t = 0; t < 8; ++t) {
            V::Words w0, w1;
            L::words(p, s, t, lane0, w0, w1);
            for (int r = 0; r < R; ++r) {
                int32_t pe, po;  // activation pairs 4t, 4t + 1 and 4t + 2, 4t + 3
                std::memcpy(&pe, x.q[r] + 32 * j + 4 * t, 4);
                std::memcpy(&po, x.q[r] + 32 * j + 4 * t + 2, 4);
                if constexpr (L::halves) {
                    V::Int& half = t < 4 ? ia[r] : ib[r];
                    half = V::dot(V::dot(half, w0, pe), w1, po);
                } else {
                    ia[r] = V::dot(ia[r], w0, pe);
                    ib[r] = V::dot(ib[r], w1, po);
                }
            }
        }
        const Scales sc = L::scales(p, s, lane0);
        for (int r = 0; r < R; ++r) {
            const V::Float xd = V::set(x.d[r][j]);
            if constexpr (L::halves) {
                acc[r] = V::fma(V::to_float(ia[r]), V::mul(sc.a0, xd), acc[r]);
                acc[r] = V::fma(V::to_float(ib[r]), V::mul(sc.a1, xd), acc[r]);
            } else {
                acc[r] = V::fma(V::to_float(V::add(ia[r], ib[r])), V::mul(sc.a0, xd), acc[r]);
            }
            if constexpr (L::has_offset) acc[r] = V::fma(sc.b, V::set(x.s[r][j]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) V::store(out + kRows * r + lane0, acc[r]);
}

template <class L, int R>
inline void group_tile(const uint8_t* g, int64_t nsub, const TileRows& x, float* out) {
    for (int lane0 = 0; lane0 < kRows; lane0 += V::W) lanes_tile<L, R>(g, nsub, x, lane0, out);
}

template <class L, typename E>
int x16_linear(const typename E::T* x, const uint8_t* w, const float* bias, typename E::T* out, int64_t M,
               int64_t N, int64_t K) {
    const int64_t nsub = K / 32;
    if (K % (32 * L::subs)) return -1;
    const Acts a = quantize_rows<E>(x, M, K);
    const int64_t groups = N / kRows, group_bytes = nsub / L::subs * L::block_bytes;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* gw = w + g * group_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += kTile) {
            const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m0));
            float tile[kTile * kRows];
            TileRows xr;
            for (int r = 0; r < rows; ++r) {
                xr.q[r] = a.q.data() + (m0 + r) * K;
                xr.d[r] = a.d.data() + (m0 + r) * nsub;
                xr.s[r] = a.s.data() + (m0 + r) * nsub;
            }
            switch (rows) {
                case 4: group_tile<L, 4>(gw, nsub, xr, tile); break;
                case 3: group_tile<L, 3>(gw, nsub, xr, tile); break;
                case 2: group_tile<L, 2>(gw, nsub, xr, tile); break;
                default: group_tile<L, 1>(gw, nsub, xr, tile); break;
            }
            for (int r = 0; r < rows; ++r) {
                typename E::T* o = out + (m0 + r) * N + g * kRows;
                for (int c = 0; c < kRows; ++c) {
                    const float v = tile[kRows * r + c];
                    o[c] = E::store(bias ? v + bias[g * kRows + c] : v);
                }
            }
        }
    }
    return 0;
}

template <typename E>
int x16_dispatch(int base, const void* x, const uint8_t* w, const float* bias, void* out, int64_t M, int64_t N,
                 int64_t K) {
    using X = const typename E::T*;
    auto* o = static_cast<typename E::T*>(out);
    switch (base) {  // the base format's code (kernels/packed.py)
        case 0: return x16_linear<Legacy<8, false, 0>, E>(static_cast<X>(x), w, bias, o, M, N, K);    // Q8_0
        case 1: return x16_linear<Legacy<4, false, -8>, E>(static_cast<X>(x), w, bias, o, M, N, K);   // Q4_0
        case 2: return x16_linear<Legacy<4, false, 1>, E>(static_cast<X>(x), w, bias, o, M, N, K);    // Q4_1
        case 3: return x16_linear<Legacy<5, false, -16>, E>(static_cast<X>(x), w, bias, o, M, N, K);  // Q5_0
        case 4: return x16_linear<Legacy<5, false, 1>, E>(static_cast<X>(x), w, bias, o, M, N, K);    // Q5_1
        case 5: return x16_linear<KQuant<false>, E>(static_cast<X>(x), w, bias, o, M, N, K);          // Q4_K
        case 6: return x16_linear<KQuant<true>, E>(static_cast<X>(x), w, bias, o, M, N, K);           // Q5_K
        case 7: return x16_linear<Q6K, E>(static_cast<X>(x), w, bias, o, M, N, K);                    // Q6_K
        case 8: return x16_linear<Legacy<8, true, 0>, E>(static_cast<X>(x), w, bias, o, M, N, K);     // I8
        case 9: return x16_linear<Legacy<4, true, -8>, E>(static_cast<X>(x), w, bias, o, M, N, K);    // I4
        default: return -1;
    }
}

}  // namespace

extern "C" {
// As ce_packed_linear (packed_linear.cpp), for an interleaved format: `base` its base format's code, w the
// N / 16 groups (N a multiple of 16).
int ce_packed_linear_x16(int base, int x_dt, const void* x, const uint8_t* w, const float* bias, void* out,
                         int64_t M, int64_t N, int64_t K) {
    if (N % kRows) return -1;
    if (x_dt == 0) return x16_dispatch<F32>(base, x, w, bias, out, M, N, K);
    if (x_dt == 1) return x16_dispatch<BF16>(base, x, w, bias, out, M, N, K);
    return -1;
}
}
