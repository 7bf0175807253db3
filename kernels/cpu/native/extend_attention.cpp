// Extend (prefill) attention on AMX tiles, the CPU kernel of kernels::extend_attention (torch_ops.cpp): flash
// attention of each request's new tokens over its paged KV cache (cached prefix + the new tokens, causal), bf16 in
// and out, float32 softmax. Compiled only where the build targets AMX; elsewhere, and for soft caps,
// sliding windows and other dtypes, kernels/portable/attention.py uses SDPA.
//
// Layouts: q [T, H, D] (token stride q_stride), out [T, H, D] contiguous, caches [S, Hkv, D], page table
// [B, table_stride] of raw slots per position, cu_q_lens [B + 1], seq_lens [B]; D % 64 == 0.
//
// Keys run in blocks of 64. Per KV head, each distinct block (its 64 slots: requests sharing a cached prefix
// share its blocks) is packed once per call: its K rows and V^T. Work items are then (request, up to 128
// query rows), a query row being one (token, head of the GQA group) pair, token-major. Each 16-row tile
// works transposed, one row per vector lane: S^T = K Q^T on AMX, the online softmax (base 2) in AVX512
// down the 64 keys (no horizontal reductions, the per-row max, sum and rescale factor are vectors), then
// O^T = O^T * alpha + V^T P^T on AMX over the blocks the tile sees (causality hides the rest).

#include <omp.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr int64_t kKeys = 64;        // keys per block
constexpr int64_t kTile = 16;        // query rows per AMX tile
constexpr int64_t kItemRows = 128;   // query rows per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Every buffer the AMX tiles and the softmax vectors stream starts on a cache line: with malloc's 16-byte
// alignment each 64-byte tile row or vector would span two lines, and the kernel ran measurably slower
// (docs/benchmarks.md, timed by scripts/ab_extend_attention.py).
constexpr int64_t kAlign = 64;

template <typename T>
T* aligned_to_line(T* p) {
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + kAlign - 1) & ~static_cast<uintptr_t>(kAlign - 1));
}

// 2^x, x >= -126 after clamping; a degree-3 minimax polynomial of the fraction (~8e-5 relative error, far
// below the bf16 rounding of the probabilities).
inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.5088767e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260466e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9327628e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999289e-1f));
    return _mm512_scalef_ps(p, n);
}

struct Problem {
    const uint16_t* q;
    const uint16_t* k_cache;
    const uint16_t* v_cache;
    uint16_t* out;
    const int32_t* table;
    const int32_t* cu_q_lens;  // null for decode (one query token a row)
    const int32_t* seq_lens;
    int64_t table_stride, q_stride, H, Hkv, D, S;
    float scale2;  // softmax scale * log2(e)
};

struct Item {
    int64_t b, row0, rows, cost;
};

// Keys [k0, k0 + n) of request b (n <= kKeys).
struct KeyBlock {
    int64_t b, k0, n;
};

constexpr int64_t kBlockElems = 2 * kKeys;  // x D: K rows, then V^T

// The packed blocks of one call: request b's j-th block is packed[index[first[b] + j]].
struct Blocks {
    std::vector<KeyBlock> distinct;
    std::vector<int64_t> first, index;
    const uint16_t* packed;  // [distinct, kBlockElems * D] for the current KV head
};

// The packed blocks of one call, in a 64-byte aligned buffer kept between calls (fresh pages would fault);
// one call at a time holds it.
class PackedBuffer {
  public:
    explicit PackedBuffer(int64_t elems) : lock_(mutex_) {
        buffer_.resize(std::max<size_t>(buffer_.size(), elems + kAlign / 2));
        data = aligned_to_line(buffer_.data());
    }
    uint16_t* data;

  private:
    static inline std::mutex mutex_;
    static inline std::vector<uint16_t> buffer_;
    std::lock_guard<std::mutex> lock_;
};

// One thread's buffers for one work item, in one allocation; a tile is 16 query rows, the lanes of the
// softmax vectors.
struct Scratch {
    uint16_t* qt;    // [tiles, D / 32, 16 dim pairs, 16 rows, 2] Q^T as AMX B tiles
    float* ot;       // [tiles, D, 16] unnormalized O^T
    float* st;       // [kKeys, 16] S^T of one block
    uint16_t* pt;    // [kKeys / 32, 16 key pairs, 16 rows, 2] P^T as AMX B tiles
    float *m, *l;    // [tiles * 16] running max (base 2) and sum
    int32_t* limit;  // [tiles * 16] keys each row sees (causal); 0 for padding rows

    explicit Scratch(int64_t D) {
        const int64_t sizes[] = {kItemRows * D * 2, kItemRows * D * 4, kKeys * kTile * 4, kKeys * kTile * 2,
                                 kItemRows * 4, kItemRows * 4, kItemRows * 4};
        int64_t offsets[7], end = 0;
        for (int i = 0; i < 7; ++i) {
            offsets[i] = (end + kAlign - 1) / kAlign * kAlign;
            end = offsets[i] + sizes[i];
        }
        arena.resize(end + kAlign);
        char* base = aligned_to_line(arena.data());
        qt = reinterpret_cast<uint16_t*>(base + offsets[0]);
        ot = reinterpret_cast<float*>(base + offsets[1]);
        st = reinterpret_cast<float*>(base + offsets[2]);
        pt = reinterpret_cast<uint16_t*>(base + offsets[3]);
        m = reinterpret_cast<float*>(base + offsets[4]);
        l = reinterpret_cast<float*>(base + offsets[5]);
        limit = reinterpret_cast<int32_t*>(base + offsets[6]);
    }

  private:
    std::vector<char> arena;
};

// The slot of position `pos` of a page-table row; out-of-range entries read slot 0 (never handed out).
inline int64_t slot_at_row(const int32_t* row, int64_t pos, int64_t S) {
    const int64_t slot = row[pos];
    return (slot < 0 || slot >= S) ? 0 : slot;
}

inline int64_t slot_at(const Problem& pr, int64_t b, int64_t pos) {
    return slot_at_row(pr.table + b * pr.table_stride, pos, pr.S);
}

// The K and V rows of a block towards L1 (their slots are random: no hardware prefetcher would guess them).
void prefetch_block(const Problem& pr, const KeyBlock& kb, int64_t h) {
    for (int64_t i = kb.k0; i < kb.k0 + kb.n; ++i) {
        const int64_t offset = (slot_at(pr, kb.b, i) * pr.Hkv + h) * pr.D;
        for (int64_t byte = 0; byte < pr.D * 2; byte += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(pr.k_cache + offset) + byte, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(pr.v_cache + offset) + byte, _MM_HINT_T0);
        }
    }
}

// A block of KV head h into dst: its K rows [kKeys, D] (AMX A tiles of 16 keys x 32 dims), then V^T
// [D, kKeys] (A tiles of 16 dims x 32 keys); keys past the block's n are zeros.
void pack_block(const Problem& pr, const KeyBlock& kb, int64_t h, uint16_t* dst) {
    const int64_t D = pr.D;
    uint16_t* vt = dst + kKeys * D;
    for (int64_t i = 0; i < kKeys; ++i) {
        uint16_t* krow = dst + i * D;
        if (i >= kb.n) {
            std::fill_n(krow, D, uint16_t{0});
            for (int64_t d = 0; d < D; ++d) vt[d * kKeys + i] = 0;
            continue;
        }
        const int64_t offset = (slot_at(pr, kb.b, kb.k0 + i) * pr.Hkv + h) * D;
        std::memcpy(krow, pr.k_cache + offset, D * 2);
        const uint16_t* v = pr.v_cache + offset;
        for (int64_t d = 0; d < D; ++d) vt[d * kKeys + i] = v[d];
    }
}

// Request b's blocks, the distinct ones (by their slots) listed once.
Blocks find_blocks(const Problem& pr, int64_t B) {
    Blocks blocks;
    blocks.first.assign(B + 1, 0);
    std::unordered_map<std::string_view, int64_t> seen;  // a block's slots, as bytes
    for (int64_t b = 0; b < B; ++b) {
        const int64_t q_len = pr.cu_q_lens[b + 1] - pr.cu_q_lens[b], len = q_len > 0 ? pr.seq_lens[b] : 0;
        for (int64_t k0 = 0; k0 < len; k0 += kKeys) {
            const int64_t n = std::min(kKeys, len - k0);
            const std::string_view key(reinterpret_cast<const char*>(pr.table + b * pr.table_stride + k0), n * 4);
            const auto [it, added] = seen.emplace(key, static_cast<int64_t>(blocks.distinct.size()));
            if (added) blocks.distinct.push_back({b, k0, n});
            blocks.index.push_back(it->second);
        }
        blocks.first[b + 1] = static_cast<int64_t>(blocks.index.size());
    }
    return blocks;
}

// Transposes 16 rows of 16 32-bit lanes in place.
inline void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

// Sixteen query rows (null: padding) into tile `tile` of sc.qt as Q^T B tiles (a 16x16 transpose of dim pairs
// per 32 dims), with a zero O^T and fresh softmax state.
void load_query_tile(const uint16_t* const rows[kTile], int64_t D, int64_t tile, Scratch& sc) {
    for (int64_t c = 0; c < D / 32; ++c) {
        __m512i r[16];  // row r: query r's dims [32c, 32c + 32) as 16 pairs; transposed: pair p's 16 rows
        for (int n = 0; n < 16; ++n) r[n] = rows[n] ? _mm512_loadu_si512(rows[n] + c * 32) : _mm512_setzero_si512();
        transpose16x16(r);
        uint16_t* out = sc.qt + (tile * (D / 32) + c) * 512;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + p * 32, r[p]);
    }
    std::fill_n(sc.ot + tile * D * kTile, D * kTile, 0.0f);
    std::fill_n(sc.m + tile * kTile, kTile, kNegInf);
    std::fill_n(sc.l + tile * kTile, kTile, 0.0f);
}

// The item's query rows and how many keys each sees; padding rows are zero queries that see no key.
void load_queries(const Problem& pr, const Item& it, int64_t h, Scratch& sc) {
    const int64_t D = pr.D, group = pr.H / pr.Hkv, q_start = pr.cu_q_lens[it.b];
    const int64_t q_len = pr.cu_q_lens[it.b + 1] - q_start, prefix = pr.seq_lens[it.b] - q_len;
    const int64_t tiles = (it.rows + kTile - 1) / kTile;
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint16_t* rows[kTile];
        for (int64_t r = 0; r < kTile; ++r) {
            const int64_t i = tile * kTile + r, row = it.row0 + i, t = row / group, head = h * group + row % group;
            const bool real = i < it.rows;
            rows[r] = real ? pr.q + (q_start + t) * pr.q_stride + head * D : nullptr;
            sc.limit[i] = real ? static_cast<int32_t>(prefix + t + 1) : 0;
        }
        load_query_tile(rows, D, tile, sc);
    }
}

// C tiles 0-3 += four A tiles of 16 rows (the first at `a`, rows `lda` elements apart, each 16 rows further)
// times the B tile at `b`. Tiles 4-7 are scratch.
inline void four_tiles_times_b(const uint16_t* a, int64_t lda, const uint16_t* b) {
    _tile_loadd(4, b, 64);
    _tile_loadd(5, a, lda * 2);
    _tile_loadd(6, a + 16 * lda, lda * 2);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(7, a + 32 * lda, lda * 2);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(5, a + 48 * lda, lda * 2);
    _tile_dpbf16ps(2, 7, 4);
    _tile_dpbf16ps(3, 5, 4);
}

// C tiles 0-3 to / from 64 rows of 16 floats at c (tile i: rows 16i to 16i + 15).
inline void store_four_tiles(float* c) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 16 * kTile, 64);
    _tile_stored(2, c + 32 * kTile, 64);
    _tile_stored(3, c + 48 * kTile, 64);
}

inline void load_four_tiles(const float* c) {
    _tile_loadd(0, c, 64);
    _tile_loadd(1, c + 16 * kTile, 64);
    _tile_loadd(2, c + 32 * kTile, 64);
    _tile_loadd(3, c + 48 * kTile, 64);
}

// S^T [kKeys, 16] = K Q^T for the tile: four C tiles of 16 keys, one B tile of Q^T per 32 dims.
void scores(Scratch& sc, const uint16_t* k, int64_t tile, int64_t D) {
    const uint16_t* qt = sc.qt + tile * (D / 32) * 512;
    tile_loads_see_stores();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < D / 32; ++c) four_tiles_times_b(k + c * 32, D, qt + c * 512);
    store_four_tiles(sc.st);
    tile_loads_see_stores();  // and the softmax's loads see the tile stores
}

// Online softmax of the block for the tile's 16 rows, one vector lane per row: P^T into sc.pt as B tiles
// (bf16 pairs of consecutive keys), running max and sum updated; returns each row's rescale factor
// 2^(m_old - m_new) (0 where a row saw no key before). Keys a row may not see (causality, past the block)
// get probability 0; a block every row sees in full skips the masks. The max is taken on the raw scores
// (the scale is positive) and the scale folded into the exponent.
__m512 softmax_block(Scratch& sc, int64_t tile, int64_t k0, int64_t keys, float scale2) {
    const int64_t first = tile * kTile;
    const __m512 neg_inf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(scale2);
    const __m512i k0v = _mm512_set1_epi32(static_cast<int32_t>(k0));
    const __m512i limit = _mm512_sub_epi32(_mm512_loadu_si512(sc.limit + first), k0v);  // keys of the block each row sees
    const bool full = keys == kKeys && sc.limit[first] - k0 >= kKeys && sc.limit[first + kTile - 1] > 0;
    auto visible = [&](int64_t j) { return _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(static_cast<int32_t>(j))); };
    __m512 mx[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    for (int64_t j = 0; j < kKeys; ++j) {
        const __m512 s = _mm512_load_ps(sc.st + j * kTile);
        mx[j % 4] = _mm512_max_ps(mx[j % 4], full ? s : _mm512_mask_mov_ps(neg_inf, visible(j), s));
    }
    const __m512 m_old = _mm512_loadu_ps(sc.m + first);
    const __m512 block_max = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(block_max, scale));
    _mm512_storeu_ps(sc.m + first, m_new);
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ);  // rows that saw a key
    const __m512 neg_m = _mm512_maskz_sub_ps(seen, _mm512_setzero_ps(), m_new);
    const __mmask16 before = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(before, exp2_16(_mm512_add_ps(m_old, neg_m)));
    // Interleaves two 16-lane bf16 halves: lane 2i from the low half, 2i + 1 from the high one.
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < kKeys; j += 2) {
        __m512 e0 = exp2_16(_mm512_fmadd_ps(_mm512_load_ps(sc.st + j * kTile), scale, neg_m));
        __m512 e1 = exp2_16(_mm512_fmadd_ps(_mm512_load_ps(sc.st + (j + 1) * kTile), scale, neg_m));
        if (!full) {
            e0 = _mm512_maskz_mov_ps(visible(j), e0);
            e1 = _mm512_maskz_mov_ps(visible(j + 1), e1);
        }
        sum[0] = _mm512_add_ps(sum[0], e0);
        sum[1] = _mm512_add_ps(sum[1], e1);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_store_si512(sc.pt + j * kTile, _mm512_permutexvar_epi16(pairs, both));
    }
    float* l = sc.l + first;
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, _mm512_add_ps(sum[0], sum[1])));
    return alpha;
}

// O^T = O^T * alpha + V^T P^T for the tile: 64 dims at a time in four C tiles, one B tile of P^T per 32
// keys. The rescale pass is skipped when no row's max moved.
void accumulate(Scratch& sc, const uint16_t* vt, int64_t tile, int64_t D, __m512 alpha) {
    float* ot = sc.ot + tile * D * kTile;
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ))
        for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(ot + d * kTile, _mm512_mul_ps(_mm512_loadu_ps(ot + d * kTile), alpha));
    tile_loads_see_stores();
    for (int64_t d = 0; d < D; d += 64) {
        load_four_tiles(ot + d * kTile);
        for (int64_t kc = 0; kc < kKeys / 32; ++kc) four_tiles_times_b(vt + d * kKeys + kc * 32, kKeys, sc.pt + kc * 512);
        store_four_tiles(ot + d * kTile);
    }
    tile_loads_see_stores();
}

// out = O / l for the item's rows: O^T transposed back 16 dims at a time.
void store_outputs(const Problem& pr, const Item& it, int64_t h, const Scratch& sc) {
    const int64_t D = pr.D, group = pr.H / pr.Hkv, q_start = pr.cu_q_lens[it.b];
    const int64_t tiles = (it.rows + kTile - 1) / kTile;
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const float* ot = sc.ot + tile * D * kTile;
        const __m512 l = _mm512_loadu_ps(sc.l + tile * kTile);
        const __m512 one = _mm512_set1_ps(1.0f);  // padding rows (l = 0) divide by 1
        const __m512 inv = _mm512_div_ps(one, _mm512_mask_mov_ps(one, _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_NEQ_OQ), l));
        uint16_t* dst[kTile];
        const int64_t rows = std::min(kTile, it.rows - tile * kTile);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = it.row0 + tile * kTile + r, t = row / group, head = h * group + row % group;
            dst[r] = pr.out + ((q_start + t) * pr.H + head) * D;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i r[16];  // row i: dim d0 + i of the 16 rows; transposed: row r's 16 dims
            for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * kTile), inv));
            transpose16x16(r);
            for (int64_t q = 0; q < rows; ++q)
                _mm256_storeu_si256((__m256i*)(dst[q] + d0), (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[q])));
        }
    }
}

void run_item(const Problem& pr, const Item& it, int64_t h, const Blocks& blocks, Scratch& sc) {
    load_queries(pr, it, h, sc);
    const int64_t tiles = (it.rows + kTile - 1) / kTile;
    const int64_t end = sc.limit[it.rows - 1];  // the item's last row sees the most keys
    for (int64_t k0 = 0; k0 < end; k0 += kKeys) {
        const uint16_t* k = blocks.packed + blocks.index[blocks.first[it.b] + k0 / kKeys] * kBlockElems * pr.D;
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t last = std::min(it.rows, (tile + 1) * kTile) - 1;
            const int64_t keys = std::min<int64_t>(kKeys, sc.limit[last] - k0);  // keys this tile sees in the block
            if (keys <= 0) continue;
            scores(sc, k, tile, pr.D);
            const __m512 alpha = softmax_block(sc, tile, k0, keys, pr.scale2);
            accumulate(sc, k + kKeys * pr.D, tile, pr.D, alpha);
        }
    }
    store_outputs(pr, it, h, sc);
}

void extend_attention(const Problem& pr, int64_t B) {
    const int64_t group = pr.H / pr.Hkv;
    std::vector<Item> items;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t q_len = pr.cu_q_lens[b + 1] - pr.cu_q_lens[b], prefix = pr.seq_lens[b] - q_len;
        for (int64_t row0 = 0; row0 < q_len * group; row0 += kItemRows) {
            const int64_t rows = std::min(kItemRows, q_len * group - row0);
            items.push_back({b, row0, rows, rows * (prefix + (row0 + rows) / group)});
        }
    }
    std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    Blocks blocks = find_blocks(pr, B);
    const int64_t nblocks = static_cast<int64_t>(blocks.distinct.size());
    const PackedBuffer packed(nblocks * kBlockElems * pr.D);  // one KV head's blocks at a time
    uint16_t* aligned = packed.data;
    blocks.packed = aligned;
#pragma omp parallel
    {
        Scratch sc(pr.D);
        configure_amx_tiles(kTile, 0);
        for (int64_t h = 0; h < pr.Hkv; ++h) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < nblocks; ++u) {
                if (u + 1 < nblocks) prefetch_block(pr, blocks.distinct[u + 1], h);
                pack_block(pr, blocks.distinct[u], h, aligned + u * kBlockElems * pr.D);
            }
#pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < items.size(); ++i) run_item(pr, items[i], h, blocks, sc);
        }
        _tile_release();
    }
}

// ---- decode rows over a shared cached prefix ----------------------------------------------------------
// Decode rows (one new token each) whose page tables start with the same slots, as radix-cache hits do: the
// group's shared full blocks run once on AMX for all its query rows together (rows of several requests in
// one tile), each row's own tail keys run in AVX512, and the two partial softmaxes are merged.

constexpr int64_t kMinShared = 4 * kKeys;  // shared keys below which the plain decode kernel is as good

struct PrefixGroup {
    std::vector<int64_t> rows;  // batch rows
    int64_t shared = 0;         // leading keys all of them share, a multiple of kKeys
};

// Every row with keys in a group of two or more rows sharing at least kMinShared leading slots; empty when
// some row has none (the plain decode kernel then serves the batch).
std::vector<PrefixGroup> prefix_groups(const int32_t* table, int64_t stride, const int32_t* seq_lens, int64_t B) {
    std::vector<PrefixGroup> groups;
    std::unordered_map<std::string_view, size_t> by_first_block;
    for (int64_t b = 0; b < B; ++b) {
        if (seq_lens[b] == 0) continue;  // a padding row: zeros
        if (seq_lens[b] < kMinShared) return {};
        const std::string_view first(reinterpret_cast<const char*>(table + b * stride), kKeys * 4);
        const auto [it, added] = by_first_block.emplace(first, groups.size());
        if (added) groups.push_back({{}, seq_lens[b] / kKeys * kKeys});
        PrefixGroup& g = groups[it->second];
        if (!g.rows.empty()) {  // shared: the leading whole blocks this row has in common with the group's first
            const int32_t* lead = table + g.rows.front() * stride;
            const int64_t n = std::min(g.shared, seq_lens[b] / kKeys * kKeys);
            int64_t same = 0;
            while (same < n && std::memcmp(lead + same, table + b * stride + same, kKeys * 4) == 0) same += kKeys;
            g.shared = same;
        }
        g.rows.push_back(b);
    }
    for (const PrefixGroup& g : groups)
        if (g.rows.size() < 2 || g.shared < kMinShared) return {};
    return groups;
}

struct DecodeItem {
    int64_t group, h, tile;  // a tile of the group's query rows (row-major over (row, GQA head)) for KV head h
};

// The tile's rows: their tail keys [shared, seq_len) in AVX512 merged with the shared part's O^T, m and l
// (base 2), then out = O / l.
void finish_rows(const Problem& pr, const PrefixGroup& g, const DecodeItem& it, const Scratch& sc,
                 std::vector<float>& scores) {
    const int64_t D = pr.D, gqa = pr.H / pr.Hkv, rows = static_cast<int64_t>(g.rows.size()) * gqa;
    alignas(64) float o[256];
    for (int64_t lane = 0; lane < kTile && it.tile * kTile + lane < rows; ++lane) {
        const int64_t i = it.tile * kTile + lane, b = g.rows[i / gqa], head = it.h * gqa + i % gqa;
        const uint16_t* q = pr.q + b * pr.q_stride + head * D;
        const int64_t tail = pr.seq_lens[b] - g.shared;
        scores.resize(std::max<size_t>(scores.size(), tail + 16));
        float m = sc.m[lane];
        for (int64_t t = 0; t < tail; ++t) {
            const int64_t slot = slot_at_row(pr.table + b * pr.table_stride, g.shared + t, pr.S);
            const uint16_t* k = pr.k_cache + (slot * pr.Hkv + it.h) * D;
            __m512 dot = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32)
                dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
            scores[t] = _mm512_reduce_add_ps(dot) * pr.scale2;
            m = std::max(m, scores[t]);
        }
        const float a = exp2_16(_mm512_set1_ps(sc.m[lane] - m))[0];
        float l = sc.l[lane] * a;
        for (int64_t d = 0; d < D; ++d) o[d] = sc.ot[d * kTile + lane] * a;
        for (int64_t t0 = 0; t0 < tail; t0 += 16) {
            const __mmask16 valid = tail - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (tail - t0)) - 1);
            const __m512 s = _mm512_maskz_loadu_ps(valid, scores.data() + t0);
            const __m512 p = _mm512_maskz_mov_ps(valid, exp2_16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
            l += _mm512_reduce_add_ps(p);
            alignas(64) float pv[16];
            _mm512_store_ps(pv, p);
            for (int64_t t = t0; t < std::min(tail, t0 + 16); ++t) {
                const int64_t slot = slot_at_row(pr.table + b * pr.table_stride, g.shared + t, pr.S);
                const uint16_t* v = pr.v_cache + (slot * pr.Hkv + it.h) * D;
                const __m512 w = _mm512_set1_ps(pv[t - t0]);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(o + d, _mm512_fmadd_ps(w, load16(v + d), _mm512_load_ps(o + d)));
            }
        }
        const __m512 inv = _mm512_set1_ps(1.0f / l);
        uint16_t* dst = pr.out + (b * pr.H + head) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + d), inv)));
    }
}

void decode_shared_prefix(const Problem& pr, const std::vector<PrefixGroup>& groups, int64_t B) {
    const int64_t D = pr.D, gqa = pr.H / pr.Hkv;
    for (int64_t b = 0; b < B; ++b)
        if (pr.seq_lens[b] == 0) std::fill_n(pr.out + b * pr.H * D, pr.H * D, uint16_t{0});
    // Packed blocks of every (group, KV head): first[gi] + h * (shared / kKeys) + j.
    std::vector<int64_t> first(groups.size() + 1, 0);
    std::vector<DecodeItem> items;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const PrefixGroup& g = groups[gi];
        first[gi + 1] = first[gi] + pr.Hkv * (g.shared / kKeys);
        const int64_t tiles = (static_cast<int64_t>(g.rows.size()) * gqa + kTile - 1) / kTile;
        for (int64_t h = 0; h < pr.Hkv; ++h)
            for (int64_t t = 0; t < tiles; ++t) items.push_back({static_cast<int64_t>(gi), h, t});
    }
    std::vector<KeyBlock> blocks(first.back());
    std::vector<int64_t> block_head(first.back());
    for (size_t gi = 0; gi < groups.size(); ++gi)
        for (int64_t h = 0; h < pr.Hkv; ++h)
            for (int64_t j = 0; j < groups[gi].shared / kKeys; ++j) {
                const int64_t u = first[gi] + h * (groups[gi].shared / kKeys) + j;
                blocks[u] = {groups[gi].rows.front(), j * kKeys, kKeys};
                block_head[u] = h;
            }
    const int64_t nblocks = static_cast<int64_t>(blocks.size());
    const PackedBuffer packed(nblocks * kBlockElems * D);
    uint16_t* aligned = packed.data;
#pragma omp parallel
    {
        Scratch sc(D);
        std::vector<float> tail_scores;
        configure_amx_tiles(kTile, 0);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < nblocks; ++u) pack_block(pr, blocks[u], block_head[u], aligned + u * kBlockElems * D);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < items.size(); ++i) {
            const DecodeItem& it = items[i];
            const PrefixGroup& g = groups[it.group];
            const int64_t rows = static_cast<int64_t>(g.rows.size()) * gqa;
            const uint16_t* q[kTile];
            for (int64_t lane = 0; lane < kTile; ++lane) {
                const int64_t r = it.tile * kTile + lane;
                q[lane] = r < rows ? pr.q + g.rows[r / gqa] * pr.q_stride + (it.h * gqa + r % gqa) * D : nullptr;
                sc.limit[lane] = r < rows ? static_cast<int32_t>(g.shared) : 0;
            }
            load_query_tile(q, D, 0, sc);
            const int64_t nb = g.shared / kKeys;
            const uint16_t* base = aligned + (first[it.group] + it.h * nb) * kBlockElems * D;
            for (int64_t j = 0; j < nb; ++j) {
                const uint16_t* k = base + j * kBlockElems * D;
                scores(sc, k, 0, D);
                const __m512 alpha = softmax_block(sc, 0, j * kKeys, kKeys, pr.scale2);
                accumulate(sc, k + kKeys * D, 0, D, alpha);
            }
            finish_rows(pr, g, it, sc, tail_scores);
        }
        _tile_release();
    }
}
#endif

}  // namespace

extern "C" {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Returns 0, or 1 when the shapes are not supported (nothing written).
int ce_extend_attention_bf16(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                             const int32_t* table, int64_t table_stride, const int32_t* cu_q_lens,
                             const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                             int64_t S, float scale) {
    if (D % 64 != 0 || D > 256 || Hkv <= 0 || H % Hkv != 0) return 1;
    const Problem pr{static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                     static_cast<const uint16_t*>(v_cache), static_cast<uint16_t*>(out), table, cu_q_lens, seq_lens,
                     table_stride, q_stride, H, Hkv, D, S, scale * 1.44269504088896341f};
    extend_attention(pr, B);
    return 0;
}

// Decode attention (q [B, H, D], one new token per row) for batches whose rows all share a cached prefix of at
// least 256 keys with another row; returns 1 (nothing written) for any other batch or shape.
int ce_decode_shared_prefix_bf16(const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                                 int64_t table_stride, const int32_t* seq_lens, void* out, int64_t B, int64_t H,
                                 int64_t Hkv, int64_t D, int64_t S, float scale) {
    if (D % 64 != 0 || D > 256 || Hkv <= 0 || H % Hkv != 0 || table_stride < kMinShared) return 1;
    const std::vector<PrefixGroup> groups = prefix_groups(table, table_stride, seq_lens, B);
    if (groups.empty()) return 1;
    const Problem pr{static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                     static_cast<const uint16_t*>(v_cache), static_cast<uint16_t*>(out), table, nullptr, seq_lens,
                     table_stride, H * D, H, Hkv, D, S, scale * 1.44269504088896341f};  // no cu_q_lens: one token a row
    decode_shared_prefix(pr, groups, B);
    return 0;
}
#endif

}  // extern "C"
