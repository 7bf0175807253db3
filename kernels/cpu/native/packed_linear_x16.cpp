// The packed linear on 16 rows interleaved (kernels/interleave.py has the layout): out = x @ W.T (+ bias) for
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, I8 and I4 weights whose N rows were regrouped at load, 16 rows a group, each
// block of 32 columns stored as the 16 rows' scales side by side (fp16, or bf16 for I8 / I4), their mins (Q4_1,
// Q5_1), their fifth bits as masks (Q5_0, Q5_1), then their quants ordered so that one load widened to 16-bit
// words holds one pair of columns for each of the 16 rows. Nothing is re-quantized: every weight keeps its
// file's bits.
//
// The activations are quantized as in packed_linear.cpp (int16 per row and block of 32, packed_acts.h). Each
// lane of a vector is one output column (one weight row): the pair products of a block are summed exactly in
// int32 (VNNI's vpdpwssd, or vpmaddwd + vpaddd), converted to float once per block and accumulated with one
// FMA by (weight scale x activation scale), then the offset (the min, or -8 d / -16 d) with one FMA by the
// activations' block sum, in order over the blocks. That is the same sequence of float operations in every
// lane, tile and thread, on AVX512, on AVX2 and in the scalar code: the kernel is batch-invariant, and its
// three paths give the same bits.

#include "packed_acts.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CE_X16_AVX512 1
#elif defined(CE_PACKED_AVX2) && defined(__F16C__)
#define CE_X16_AVX2 1
#endif

namespace {

constexpr int kRows = 16;  // weight rows per group: one per lane of a 512-bit float vector

// Layout traits of an interleaved format (by its base format's code): quant bits (8, 5 or 4), whether the
// scales are bf16 (else fp16), and the offset: 0 none, 1 a second scale field (the min m: w = d q + m), or a
// negative multiplier of the scale (-8: w = d (q - 8)).
template <int Bits, bool Bf16, int Offset>
struct X16 {
    static constexpr int bits = Bits, offset = Offset;
    static constexpr bool bf16 = Bf16;
    static constexpr int masks = 2 * kRows * (Offset == 1 ? 2 : 1);      // where the fifth bits' masks start
    static constexpr int head = masks + (Bits == 5 ? 4 * kRows : 0);     // bytes before the quants of a block
    static constexpr int quant_bytes = kRows * 32 * (Bits == 8 ? 8 : 4) / 8;  // the 16 rows' quants (low bits)
    static constexpr int block_bytes = head + quant_bytes;
};
using X16_Q8_0 = X16<8, false, 0>;
using X16_Q4_0 = X16<4, false, -8>;
using X16_Q4_1 = X16<4, false, 1>;
using X16_Q5_0 = X16<5, false, -16>;
using X16_Q5_1 = X16<5, false, 1>;
using X16_I8 = X16<8, true, 0>;
using X16_I4 = X16<4, true, -8>;

inline uint32_t u32_at(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Weight row c's quant k of the block at p: 8-bit: byte 32 (k/2) + 2c + k%2 of the quants; 4-bit: k = 4t + 2h +
// kk is nibble h (0 low, 1 high) of byte 32t + 2c + kk, and (5-bit) bit 2c + kk of mask (t, h) its fifth bit.
template <class L>
inline int quant_at(const uint8_t* p, int c, int k) {
    const uint8_t* q = p + L::head;
    if constexpr (L::bits == 8) {
        return static_cast<int8_t>(q[32 * (k / 2) + 2 * c + k % 2]);
    } else {
        const uint8_t byte = q[32 * (k / 4) + 2 * c + k % 2];
        int v = (k / 2) % 2 ? byte >> 4 : byte & 0xF;
        if constexpr (L::bits == 5) v |= ((u32_at(p + L::masks + 4 * (k / 2)) >> (2 * c + k % 2)) & 1) << 4;
        return v;
    }
}

template <class L>
inline float scale_at(const uint8_t* p, int c) {
    return L::bf16 ? bf16_at(p + 2 * c) : f16_at(p + 2 * c);
}

constexpr int kTile = 4;  // activation rows per tile, at most

// The activation rows of a tile: row r's quants, scales and scaled sums.
struct TileRows {
    const int16_t* q[kTile];
    const float* d[kTile];
    const float* s[kTile];
};

#if defined(CE_X16_AVX2)
// The low 16 bits of a mask -> 16 words, 16 where the bit is set.
inline __m256i fifth_bits(uint32_t mask) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<int16_t>(0x8000));
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(mask)), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi16(16));
}
#endif

// One group's 16 output columns for R rows of x: out[r * 16 + c].
template <class L, int R>
inline void group_tile(const uint8_t* g, int64_t nb, const TileRows& x, float* out) {
#if defined(CE_X16_AVX512)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* p = g + j * L::block_bytes;
        const uint8_t* q = p + L::head;
        __m512i ia[R], ib[R];  // two integer chains per row (integer sums: their split changes nothing)
        for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm512_setzero_si512();
        // chunk t: the column pairs u = 2t (even chain) and 2t + 1 (odd chain) of each row
        auto step = [&](int t, __m512i w_even, __m512i w_odd) {
            for (int r = 0; r < R; ++r) {
                int32_t pe, po;
                std::memcpy(&pe, x.q[r] + 32 * j + 4 * t, 4);
                std::memcpy(&po, x.q[r] + 32 * j + 4 * t + 2, 4);
#if defined(__AVX512VNNI__)
                ia[r] = _mm512_dpwssd_epi32(ia[r], w_even, _mm512_set1_epi32(pe));
                ib[r] = _mm512_dpwssd_epi32(ib[r], w_odd, _mm512_set1_epi32(po));
#else
                ia[r] = _mm512_add_epi32(ia[r], _mm512_madd_epi16(w_even, _mm512_set1_epi32(pe)));
                ib[r] = _mm512_add_epi32(ib[r], _mm512_madd_epi16(w_odd, _mm512_set1_epi32(po)));
#endif
            }
        };
        for (int t = 0; t < 8; ++t) {
            if constexpr (L::bits != 8) {
                const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * t)));
                __m512i lo = _mm512_and_si512(z, _mm512_set1_epi16(0x0F)), hi = _mm512_srli_epi16(z, 4);
                if constexpr (L::bits == 5) {  // fifth bits: +16 where the mask is set
                    const __m512i sixteen = _mm512_set1_epi16(16);
                    lo = _mm512_mask_add_epi16(lo, u32_at(p + L::masks + 8 * t), lo, sixteen);
                    hi = _mm512_mask_add_epi16(hi, u32_at(p + L::masks + 8 * t + 4), hi, sixteen);
                }
                step(t, lo, hi);
            } else {
                step(t, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * t))),
                     _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * t + 32))));
            }
        }
        const __m256i a16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m512 a = L::bf16 ? load16_bf16(a16) : _mm512_cvtph_ps(a16);
        __m512 b = _mm512_setzero_ps();
        if constexpr (L::offset == 1) {
            b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kRows)));
        } else if constexpr (L::offset < 0) {
            b = _mm512_mul_ps(a, _mm512_set1_ps(static_cast<float>(L::offset)));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(ia[r], ib[r]));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(a, _mm512_set1_ps(x.d[r][j])), acc[r]);
            if constexpr (L::offset != 0) acc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(x.s[r][j]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + kRows * r, acc[r]);
#elif defined(CE_X16_AVX2)
    // two halves of 8 columns: half h's quants are the second 16 bytes of each 32 (8-bit: of each 32 of a pair)
    for (int h = 0; h < 2; ++h) {
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; ++j) {
            const uint8_t* p = g + j * L::block_bytes;
            const uint8_t* q = p + L::head + 16 * h;
            __m256i ia[R], ib[R];
            for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm256_setzero_si256();
            auto step = [&](int t, __m256i w_even, __m256i w_odd) {
                for (int r = 0; r < R; ++r) {
                    int32_t pe, po;
                    std::memcpy(&pe, x.q[r] + 32 * j + 4 * t, 4);
                    std::memcpy(&po, x.q[r] + 32 * j + 4 * t + 2, 4);
                    ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(w_even, _mm256_set1_epi32(pe)));
                    ib[r] = _mm256_add_epi32(ib[r], _mm256_madd_epi16(w_odd, _mm256_set1_epi32(po)));
                }
            };
            for (int t = 0; t < 8; ++t) {
                if constexpr (L::bits != 8) {
                    const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * t)));
                    __m256i lo = _mm256_and_si256(z, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(z, 4);
                    if constexpr (L::bits == 5) {
                        lo = _mm256_or_si256(lo, fifth_bits(u32_at(p + L::masks + 8 * t) >> (16 * h)));
                        hi = _mm256_or_si256(hi, fifth_bits(u32_at(p + L::masks + 8 * t + 4) >> (16 * h)));
                    }
                    step(t, lo, hi);
                } else {
                    step(t, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 64 * t))),
                         _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 64 * t + 32))));
                }
            }
            const __m128i a8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h));
            const __m256 a = L::bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a8), 16))
                                     : _mm256_cvtph_ps(a8);
            __m256 b = _mm256_setzero_ps();
            if constexpr (L::offset == 1) {
                b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kRows + 16 * h)));
            } else if constexpr (L::offset < 0) {
                b = _mm256_mul_ps(a, _mm256_set1_ps(static_cast<float>(L::offset)));
            }
            for (int r = 0; r < R; ++r) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(ia[r], ib[r]));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(a, _mm256_set1_ps(x.d[r][j])), acc[r]);
                if constexpr (L::offset != 0) acc[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(x.s[r][j]), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + kRows * r + 8 * h, acc[r]);
    }
#else
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < kRows; ++c) {
            float acc = 0.0f;
            for (int64_t j = 0; j < nb; ++j) {
                const uint8_t* p = g + j * L::block_bytes;
                int32_t dot = 0;
                for (int k = 0; k < 32; ++k) dot += quant_at<L>(p, c, k) * x.q[r][32 * j + k];
                const float a = scale_at<L>(p, c);
                acc = std::fma(static_cast<float>(dot), a * x.d[r][j], acc);
                if constexpr (L::offset == 1) acc = std::fma(scale_at<L>(p + 2 * kRows, c), x.s[r][j], acc);
                if constexpr (L::offset < 0) acc = std::fma(a * static_cast<float>(L::offset), x.s[r][j], acc);
            }
            out[kRows * r + c] = acc;
        }
    }
#endif
}

template <class L, typename E>
void x16_linear(const typename E::T* x, const uint8_t* w, const float* bias, typename E::T* out, int64_t M,
                int64_t N, int64_t K) {
    const Acts a = quantize_rows<E>(x, M, K);
    const int64_t nb = K / 32, groups = N / kRows, group_bytes = nb * L::block_bytes;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* gw = w + g * group_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += kTile) {
            const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m0));
            float tile[kTile * kRows];
            TileRows x4;
            for (int r = 0; r < rows; ++r) {
                x4.q[r] = a.q.data() + (m0 + r) * K;
                x4.d[r] = a.d.data() + (m0 + r) * nb;
                x4.s[r] = a.s.data() + (m0 + r) * nb;
            }
            switch (rows) {
                case 4: group_tile<L, 4>(gw, nb, x4, tile); break;
                case 3: group_tile<L, 3>(gw, nb, x4, tile); break;
                case 2: group_tile<L, 2>(gw, nb, x4, tile); break;
                default: group_tile<L, 1>(gw, nb, x4, tile); break;
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
}

template <typename E>
int x16_dispatch(int base, const void* x, const uint8_t* w, const float* bias, void* out, int64_t M, int64_t N,
                 int64_t K) {
    using X = const typename E::T*;
    auto* o = static_cast<typename E::T*>(out);
    switch (base) {  // the base format's code (kernels/packed.py)
        case 0: x16_linear<X16_Q8_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 1: x16_linear<X16_Q4_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 2: x16_linear<X16_Q4_1, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 3: x16_linear<X16_Q5_0, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 4: x16_linear<X16_Q5_1, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 8: x16_linear<X16_I8, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
        case 9: x16_linear<X16_I4, E>(static_cast<X>(x), w, bias, o, M, N, K); return 0;
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
