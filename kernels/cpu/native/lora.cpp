// LoRA adapters' batched delta (kernels::lora_delta on the CPU) as a grouped GEMM: the step's tokens are
// grouped by adapter slot, and each group is multiplied by its adapter's A, then by its B (S-LoRA's and
// punica's segmented shrink-then-expand), in tiles of rows, so that an adapter's weights are read once per
// tile of tokens rather than once per token. Tokens of the last slot (no adapter: it holds zeros) get zeros
// and cost nothing.
//
// Token t with slot s gets h = A[s] x_t (float32; each element a fixed sum of 16 lane chains over k, then
// the tail), then out_t[n] = sum over r of h[r] B[s][r][n] over the r of the projection that column n
// belongs to (`part_rows`: B is block-diagonal by projection, q / k / v or gate / up), one chain over r
// in order, rounded once. Every element is computed by the same code whatever tile it falls in (tiles are
// padded, never cut short), so a token's result depends on its own row and adapter alone: batch-invariant,
// and the same bits in a decode row and an extend row.

#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kMr = 4;      // rows of a tile
constexpr int kLanes = 16;  // the shrink's lane chains over k; the expand's columns per vector
constexpr int kShrinkNr = 4;
constexpr int kExpandCols = 4 * kLanes;

// h[i][j] = dot(x[i], a[j]) for kMr rows of x (float32, K apart) and kShrinkNr rows of A (`a[j]`).
template <class E>
inline void shrink_tile(const float* x, const typename E::T* const* a, int64_t K, float h[kMr][kShrinkNr]) {
    float acc[kMr][kShrinkNr][kLanes] = {};
    const int64_t k16 = K / kLanes * kLanes;
    for (int64_t k = 0; k < k16; k += kLanes) {
        float av[kShrinkNr][kLanes];
        for (int j = 0; j < kShrinkNr; ++j)
            for (int l = 0; l < kLanes; ++l) av[j][l] = E::load(a[j][k + l]);
        for (int i = 0; i < kMr; ++i) {
            const float* xi = x + i * K + k;
            for (int j = 0; j < kShrinkNr; ++j)
                for (int l = 0; l < kLanes; ++l) acc[i][j][l] += xi[l] * av[j][l];
        }
    }
    for (int i = 0; i < kMr; ++i)
        for (int j = 0; j < kShrinkNr; ++j) {
            float sum = 0.0f;
            for (int l = 0; l < kLanes; ++l) sum += acc[i][j][l];
            for (int64_t k = k16; k < K; ++k) sum += x[i * K + k] * E::load(a[j][k]);
            h[i][j] = sum;
        }
}

// acc[i][c] = sum over r < R of h[i][r] * b[r * ldb + c], for kMr rows and kExpandCols columns.
template <class E>
inline void expand_tile(const float* const* h, const typename E::T* b, int64_t ldb, int64_t R,
                        float acc[kMr][kExpandCols]) {
    for (int i = 0; i < kMr; ++i)
        for (int c = 0; c < kExpandCols; ++c) acc[i][c] = 0.0f;
    for (int64_t r = 0; r < R; ++r) {
        float bv[kExpandCols];
        for (int c = 0; c < kExpandCols; ++c) bv[c] = E::load(b[r * ldb + c]);
        for (int i = 0; i < kMr; ++i) {
            const float hr = h[i][r];
            for (int c = 0; c < kExpandCols; ++c) acc[i][c] += hr * bv[c];
        }
    }
}

// o[c] = acc[c] rounded, c < cols.
template <class E>
inline void store_row(typename E::T* o, const float* acc, int64_t cols) {
    for (int64_t c = 0; c < cols; ++c) o[c] = E::store(acc[c]);
}

#if defined(__AVX512F__)
// f32_to_bf16 on 16 lanes (round to nearest even; NaN to 0x7FC0).
inline __m256i round16_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

template <>
inline void store_row<BF16>(uint16_t* o, const float* acc, int64_t cols) {
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), round16_bf16(_mm512_loadu_ps(acc + c)));
    for (; c < cols; ++c) o[c] = f32_to_bf16(acc[c]);
}

// The same two tiles in AVX512 registers: the same chains (lane l of the shrink's accumulator sums the k
// with k % 16 == l, each multiply-add fused), the same final sums.
template <>
inline void shrink_tile<BF16>(const float* x, const uint16_t* const* a, int64_t K, float h[kMr][kShrinkNr]) {
    __m512 acc[kMr][kShrinkNr];
    for (int i = 0; i < kMr; ++i)
        for (int j = 0; j < kShrinkNr; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t k16 = K / kLanes * kLanes;
    for (int64_t k = 0; k < k16; k += kLanes) {
        __m512 av[kShrinkNr];
        for (int j = 0; j < kShrinkNr; ++j) av[j] = load16(a[j] + k);
        for (int i = 0; i < kMr; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < kShrinkNr; ++j) acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
        }
    }
    for (int i = 0; i < kMr; ++i)
        for (int j = 0; j < kShrinkNr; ++j) {
            alignas(64) float lanes[kLanes];
            _mm512_store_ps(lanes, acc[i][j]);
            float sum = 0.0f;
            for (int l = 0; l < kLanes; ++l) sum += lanes[l];
            for (int64_t k = k16; k < K; ++k) sum += x[i * K + k] * BF16::load(a[j][k]);
            h[i][j] = sum;
        }
}

template <>
inline void expand_tile<BF16>(const float* const* h, const uint16_t* b, int64_t ldb, int64_t R,
                              float out[kMr][kExpandCols]) {
    constexpr int kV = kExpandCols / kLanes;
    __m512 acc[kMr][kV];
    for (int i = 0; i < kMr; ++i)
        for (int v = 0; v < kV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
        __m512 bv[kV];
        for (int v = 0; v < kV; ++v) bv[v] = load16(b + r * ldb + v * kLanes);
        for (int i = 0; i < kMr; ++i) {
            const __m512 hr = _mm512_set1_ps(h[i][r]);
            for (int v = 0; v < kV; ++v) acc[i][v] = _mm512_fmadd_ps(hr, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < kMr; ++i)
        for (int v = 0; v < kV; ++v) _mm512_storeu_ps(out[i] + v * kLanes, acc[i][v]);
}
#endif

template <class E>
void lora_grouped(const typename E::T* x, int64_t x_stride, const typename E::T* a, const typename E::T* b,
                  const int64_t* slots, typename E::T* out, int64_t tokens, int64_t S, int64_t W, int64_t K,
                  int64_t N, const int64_t* part_rows, int64_t parts) {
    using T = typename E::T;
    const int64_t R = W / parts;
    // the tokens of each slot, in order (the last slot: no adapter)
    std::vector<int64_t> start(S + 1, 0), order(tokens);
    auto slot = [&](int64_t t) { return slots[t] < 0 ? slots[t] + S : slots[t]; };  // in [-S, S)
    for (int64_t t = 0; t < tokens; ++t) ++start[slot(t) + 1];
    for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
    {
        std::vector<int64_t> fill(start.begin(), start.end() - 1);
        for (int64_t t = 0; t < tokens; ++t) order[fill[slot(t)]++] = t;
    }
    struct Tile {
        int64_t slot, first, rows;  // rows order[first .. first + rows) of `slot`
    };
    std::vector<Tile> tiles;
    for (int64_t s = 0; s + 1 < S; ++s)
        for (int64_t i = start[s]; i < start[s + 1]; i += kMr)
            tiles.push_back({s, i, std::min<int64_t>(kMr, start[s + 1] - i)});
    for (int64_t i = start[S - 1]; i < tokens; ++i) std::fill(out + order[i] * N, out + (order[i] + 1) * N, E::store(0.0f));
    if (tiles.empty()) return;

    const int64_t w_pad = (W + kShrinkNr - 1) / kShrinkNr * kShrinkNr;
    std::vector<float> h(tiles.size() * kMr * w_pad);  // each tile's rows of h, padded rows included
    const std::vector<T> zeros_a(K, E::store(0.0f));
    const int64_t n_blocks = (N + kExpandCols - 1) / kExpandCols;
#pragma omp parallel
    {
        std::vector<float> xt(kMr * K);
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < static_cast<int64_t>(tiles.size()); ++ti) {
            const Tile tile = tiles[ti];
            for (int i = 0; i < kMr; ++i) {
                float* row = xt.data() + i * K;
                if (i < tile.rows) {
                    const T* src = x + order[tile.first + i] * x_stride;
                    for (int64_t k = 0; k < K; ++k) row[k] = E::load(src[k]);
                } else {
                    std::fill(row, row + K, 0.0f);
                }
            }
            const T* as = a + tile.slot * W * K;
            float* ht = h.data() + ti * kMr * w_pad;
            for (int64_t r0 = 0; r0 < w_pad; r0 += kShrinkNr) {
                const T* rows[kShrinkNr];
                for (int j = 0; j < kShrinkNr; ++j) rows[j] = r0 + j < W ? as + (r0 + j) * K : zeros_a.data();
                float hv[kMr][kShrinkNr];
                shrink_tile<E>(xt.data(), rows, K, hv);
                for (int i = 0; i < kMr; ++i)
                    for (int j = 0; j < kShrinkNr; ++j) ht[i * w_pad + r0 + j] = hv[i][j];
            }
        }
        std::vector<T> b_pad(R * kExpandCols);
#pragma omp for schedule(static) collapse(2)
        for (int64_t ti = 0; ti < static_cast<int64_t>(tiles.size()); ++ti)
            for (int64_t nb = 0; nb < n_blocks; ++nb) {
                const Tile tile = tiles[ti];
                const T* bs = b + tile.slot * W * N;
                const float* ht = h.data() + ti * kMr * w_pad;
                for (int64_t p = 0; p < parts; ++p) {
                    const int64_t lo = std::max(part_rows[p], nb * kExpandCols);
                    const int64_t hi = std::min(part_rows[p + 1], (nb + 1) * kExpandCols);
                    for (int64_t c0 = lo; c0 < hi; c0 += kExpandCols) {
                        const int64_t cols = std::min<int64_t>(kExpandCols, hi - c0);
                        const T* bp = bs + p * R * N + c0;
                        int64_t ldb = N;
                        if (cols < kExpandCols) {  // the same code on a zero-padded copy
                            std::fill(b_pad.begin(), b_pad.end(), E::store(0.0f));
                            for (int64_t r = 0; r < R; ++r) std::copy(bp + r * N, bp + r * N + cols, b_pad.data() + r * kExpandCols);
                            bp = b_pad.data();
                            ldb = kExpandCols;
                        }
                        const float* hr[kMr];
                        for (int i = 0; i < kMr; ++i) hr[i] = ht + i * w_pad + p * R;
                        float acc[kMr][kExpandCols];
                        expand_tile<E>(hr, bp, ldb, R, acc);
                        for (int i = 0; i < tile.rows; ++i)
                            store_row<E>(out + order[tile.first + i] * N + c0, acc[i], cols);
                    }
                }
            }
    }
}

}  // namespace

// dt: 0 float32, 1 bfloat16; x [tokens, K] rows `x_stride` apart, a [S, W, K], b [S, W, N] (B transposed,
// as the slots store it), out [tokens, N] contiguous; part_rows: parts + 1 column boundaries of B's
// projections, W = parts * R.
extern "C" void ce_lora_delta(int dt, const void* x, int64_t x_stride, const void* a, const void* b,
                              const int64_t* slots, void* out, int64_t tokens, int64_t S, int64_t W, int64_t K,
                              int64_t N, const int64_t* part_rows, int64_t parts) {
    if (dt == 0)
        lora_grouped<F32>(static_cast<const float*>(x), x_stride, static_cast<const float*>(a),
                          static_cast<const float*>(b), slots, static_cast<float*>(out), tokens, S, W, K, N,
                          part_rows, parts);
    else
        lora_grouped<BF16>(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(a),
                           static_cast<const uint16_t*>(b), slots, static_cast<uint16_t*>(out), tokens, S, W, K,
                           N, part_rows, parts);
}
