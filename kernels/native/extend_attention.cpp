// Extend (prefill) attention on AMX tiles, the CPU kernel of kernels::extend_attention (torch_ops.cpp; also
// called through ctypes by kernels/cpu_native.py): flash attention
// of each request's new tokens over its paged KV cache (cached prefix + the new tokens, causal), bf16 in
// and out, float32 softmax. Compiled only where the build targets AMX; elsewhere, and for soft caps,
// sliding windows and other dtypes, kernels/cpu_attention.py uses SDPA.
//
// Layouts: q [T, H, D] (token stride q_stride), out [T, H, D] contiguous, caches [S, Hkv, D], page table
// [B, table_stride] of raw slots per position, cu_q_lens [B + 1], seq_lens [B]; D % 64 == 0.
//
// Keys run in blocks of 64. Per KV head, each distinct block (its 64 slots: requests sharing a cached prefix
// share its blocks) is packed once per call: K transposed into AMX B tiles, V interleaved into pairs. Work
// items are then (request, up to 128 query rows), a query row being one (token, head of the GQA group)
// pair, token-major; each 16-row tile runs S = Q K^T on AMX, the online softmax (base 2) in AVX512 and
// O += P V on AMX over the blocks it sees (causality hides the rest).

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

// 2^x, x >= -126 after clamping; a degree-5 Taylor polynomial of the fraction (~2e-6 relative error, far
// below the bf16 rounding of the probabilities).
inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

struct Problem {
    const uint16_t* q;
    const uint16_t* k_cache;
    const uint16_t* v_cache;
    uint16_t* out;
    const int32_t* table;
    const int32_t* cu_q_lens;
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

constexpr int64_t kBlockElems = 2 * kKeys;  // x D: K^T tiles, then V tiles

// The packed blocks of one call: request b's j-th block is packed[index[first[b] + j]].
struct Blocks {
    std::vector<KeyBlock> distinct;
    std::vector<int64_t> first, index;
    const uint16_t* packed;  // [distinct, kBlockElems * D] for the current KV head
};

// One thread's buffers for one work item.
struct Scratch {
    std::vector<uint16_t> q;     // [kItemRows, D] the item's query rows (zero padding)
    std::vector<float> o;        // [kItemRows, D] unnormalized outputs
    std::vector<float> m, l;     // [kItemRows] running max (base 2) and sum
    std::vector<int64_t> limit;  // [kItemRows] keys each row sees (causal)
    std::vector<float> c;        // [kTile, D] one P V product
    alignas(64) float s[kTile * kKeys];
    alignas(64) uint16_t p[kTile * kKeys];
    alignas(64) float alpha[kTile];

    explicit Scratch(int64_t D)
        : q(kItemRows * D), o(kItemRows * D), m(kItemRows), l(kItemRows), limit(kItemRows), c(kTile * D) {}
};

inline int64_t slot_at(const Problem& pr, int64_t b, int64_t pos) {
    const int64_t slot = pr.table[b * pr.table_stride + pos];
    return (slot < 0 || slot >= pr.S) ? 0 : slot;
}

// The item's query rows into sc.q, and fresh softmax state.
void load_queries(const Problem& pr, const Item& it, int64_t h, Scratch& sc) {
    const int64_t D = pr.D, group = pr.H / pr.Hkv, q_start = pr.cu_q_lens[it.b];
    const int64_t q_len = pr.cu_q_lens[it.b + 1] - q_start, prefix = pr.seq_lens[it.b] - q_len;
    for (int64_t r = 0; r < kItemRows; ++r) {
        uint16_t* dst = sc.q.data() + r * D;
        sc.m[r] = kNegInf;
        sc.l[r] = 0.0f;
        std::fill_n(sc.o.data() + r * D, D, 0.0f);
        if (r < it.rows) {
            const int64_t row = it.row0 + r, t = row / group, head = h * group + row % group;
            std::memcpy(dst, pr.q + (q_start + t) * pr.q_stride + head * D, D * 2);
            sc.limit[r] = prefix + t + 1;
        } else {
            std::fill_n(dst, D, uint16_t{0});
            sc.limit[r] = 0;
        }
    }
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

// A block of KV head h into dst: K^T as B tiles [kKeys / 16, D / 32] (16 dim pairs x 16 keys), then V as
// B tiles [kKeys / 32, D / 16] (16 key pairs x 16 dims); keys past the block's n are zeros.
void pack_block(const Problem& pr, const KeyBlock& kb, int64_t h, uint16_t* dst) {
    const int64_t D = pr.D, chunks = D / 32, dtiles = D / 16;
    const uint16_t* krows[kKeys];
    const uint16_t* vrows[kKeys];
    for (int64_t i = 0; i < kKeys; ++i) {
        const int64_t offset = i < kb.n ? (slot_at(pr, kb.b, kb.k0 + i) * pr.Hkv + h) * D : -1;
        krows[i] = offset >= 0 ? pr.k_cache + offset : nullptr;
        vrows[i] = offset >= 0 ? pr.v_cache + offset : nullptr;
    }
    for (int64_t tile = 0; tile < kKeys / 16; ++tile)
        for (int64_t c = 0; c < chunks; ++c) {
            __m512i r[16];  // row n: key n's dims [32c, 32c + 32) as 16 pairs; transposed: pair p's 16 keys
            for (int n = 0; n < 16; ++n) {
                const uint16_t* row = krows[tile * 16 + n];
                r[n] = row ? _mm512_loadu_si512(row + c * 32) : _mm512_setzero_si512();
            }
            transpose16x16(r);
            uint16_t* out = dst + (tile * chunks + c) * 512;
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + p * 32, r[p]);
        }
    uint16_t* vp = dst + kKeys * D;
    for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
        const uint16_t* a = vrows[2 * pair];
        const uint16_t* z = vrows[2 * pair + 1];
        uint16_t* out = vp + ((pair / 16) * dtiles * 16 + pair % 16) * 32;
        for (int64_t d = 0; d < dtiles; ++d) {
            const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d * 16))) : _mm512_setzero_si512();
            const __m512i hi = z ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(z + d * 16))) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + d * 16 * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
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

// S [16, kKeys] = the tile's queries . K^T: four C tiles of 16 keys, one A tile of queries per 32 dims.
void scores(Scratch& sc, const uint16_t* kt, int64_t tile, int64_t D) {
    tile_loads_see_stores();
    const uint16_t* q = sc.q.data() + tile * kTile * D;
    const int64_t chunks = D / 32, step = chunks * 512;  // B tiles of consecutive key tiles
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* b = kt + c * 512;
        _tile_loadd(4, q + c * 32, D * 2);
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + step, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(7, b + 2 * step, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 3 * step, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sc.s, kKeys * 4);
    _tile_stored(1, sc.s + 16, kKeys * 4);
    _tile_stored(2, sc.s + 32, kKeys * 4);
    _tile_stored(3, sc.s + 48, kKeys * 4);
}

// Online softmax of the tile's scores over its first `keys` keys: probabilities into sc.p (bf16, zero past
// each row's keys), each row's rescale factor into sc.alpha, running max and sum updated. A row's 64
// scores stay in four registers; the max is taken on the raw scores (the scale is positive) and the scale
// folded into the exponent, and a tile whose rows all see the whole block skips the masks.
void softmax_block(Scratch& sc, int64_t tile, int64_t k0, int64_t keys, float scale2) {
    static_assert(kKeys == 64, "a row of the block is four vectors");
    const __m512 scale = _mm512_set1_ps(scale2), neg_inf = _mm512_set1_ps(kNegInf);
    const int64_t first_row = tile * kTile;
    const bool full = keys == kKeys && sc.limit[first_row] - k0 >= kKeys && sc.limit[first_row + kTile - 1] > 0;
    alignas(64) float m_old[kTile], m_new[kTile], sums[kTile];
    for (int64_t r = 0; r < kTile; ++r) {
        const int64_t row = first_row + r;
        const int64_t valid = full ? kKeys : std::min(keys, sc.limit[row] - k0);
        const float* s = sc.s + r * kKeys;
        __m512 x[4];
        for (int v = 0; v < 4; ++v)
            x[v] = full ? _mm512_load_ps(s + 16 * v) : _mm512_mask_load_ps(neg_inf, first_lanes(valid - 16 * v), s + 16 * v);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
        m_old[r] = sc.m[row];
        m_new[r] = std::max(m_old[r], mx * scale2);
        uint16_t* p = sc.p + r * kKeys;
        if (m_new[r] == kNegInf) {  // no key yet: a padding row
            std::fill_n(p, kKeys, uint16_t{0});
            m_old[r] = m_new[r] = sums[r] = 0.0f;  // alpha 1
            continue;
        }
        const __m512 neg_m = _mm512_set1_ps(-m_new[r]);
        __m512 e[4];
        for (int v = 0; v < 4; ++v) e[v] = exp2_16(_mm512_fmadd_ps(x[v], scale, neg_m));  // -inf -> 2^-126
        if (!full)
            for (int v = 0; v < 4; ++v) e[v] = _mm512_maskz_mov_ps(first_lanes(valid - 16 * v), e[v]);
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
        _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_storeu_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
        sc.m[row] = m_new[r];
    }
    // alpha = 2^(m_old - m_new), 0 on a row's first block (m_old = -inf); l = l * alpha + sum.
    const __m512 mo = _mm512_load_ps(m_old), mn = _mm512_load_ps(m_new);
    const __mmask16 first = _mm512_cmp_ps_mask(mo, neg_inf, _CMP_EQ_OQ);
    const __m512 alpha = _mm512_mask_mov_ps(exp2_16(_mm512_sub_ps(mo, mn)), first, _mm512_setzero_ps());
    _mm512_store_ps(sc.alpha, alpha);
    float* l = sc.l.data() + first_row;
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, _mm512_load_ps(sums)));
}

// O = O * alpha + P V for the tile: 64 output dims at a time in four C tiles, one A tile of P per 32 keys.
void accumulate(Scratch& sc, const uint16_t* vp, int64_t tile, int64_t D) {
    tile_loads_see_stores();
    const int64_t dtiles = D / 16;
    for (int64_t d = 0; d < dtiles; d += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < kKeys / 32; ++kc) {
            const uint16_t* b = vp + (kc * dtiles + d) * 512;
            _tile_loadd(4, sc.p + kc * 32, kKeys * 2);
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(7, b + 1024, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, b + 1536, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, sc.c.data() + d * 16, D * 4);
        _tile_stored(1, sc.c.data() + (d + 1) * 16, D * 4);
        _tile_stored(2, sc.c.data() + (d + 2) * 16, D * 4);
        _tile_stored(3, sc.c.data() + (d + 3) * 16, D * 4);
    }
    for (int64_t r = 0; r < kTile; ++r) {
        float* o = sc.o.data() + (tile * kTile + r) * D;
        const float* c = sc.c.data() + r * D;
        const __m512 a = _mm512_set1_ps(sc.alpha[r]);
        for (int64_t j = 0; j < D; j += 16)
            _mm512_storeu_ps(o + j, _mm512_fmadd_ps(_mm512_loadu_ps(o + j), a, _mm512_loadu_ps(c + j)));
    }
}

void store_outputs(const Problem& pr, const Item& it, int64_t h, const Scratch& sc) {
    const int64_t D = pr.D, group = pr.H / pr.Hkv, q_start = pr.cu_q_lens[it.b];
    for (int64_t r = 0; r < it.rows; ++r) {
        const int64_t row = it.row0 + r, t = row / group, head = h * group + row % group;
        uint16_t* dst = pr.out + ((q_start + t) * pr.H + head) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / sc.l[r]);
        for (int64_t j = 0; j < D; j += 16)
            _mm256_storeu_si256((__m256i*)(dst + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sc.o.data() + r * D + j), inv)));
    }
}

void run_item(const Problem& pr, const Item& it, int64_t h, const Blocks& blocks, Scratch& sc) {
    load_queries(pr, it, h, sc);
    const int64_t tiles = (it.rows + kTile - 1) / kTile;
    const int64_t end = sc.limit[it.rows - 1];  // the item's last row sees the most keys
    for (int64_t k0 = 0; k0 < end; k0 += kKeys) {
        const uint16_t* kt = blocks.packed + blocks.index[blocks.first[it.b] + k0 / kKeys] * kBlockElems * pr.D;
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t last = std::min(it.rows, (tile + 1) * kTile) - 1;
            const int64_t keys = std::min(kKeys, sc.limit[last] - k0);  // keys this tile sees in the block
            if (keys <= 0) continue;
            scores(sc, kt, tile, pr.D);
            softmax_block(sc, tile, k0, keys, pr.scale2);
            accumulate(sc, kt + kKeys * pr.D, tile, pr.D);
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
    // One KV head's packed blocks at a time, in a buffer kept between calls (fresh pages would fault).
    static std::mutex mutex;
    static std::vector<uint16_t> packed;
    const std::lock_guard<std::mutex> lock(mutex);
    const int64_t nblocks = static_cast<int64_t>(blocks.distinct.size());
    packed.resize(std::max<size_t>(packed.size(), nblocks * kBlockElems * pr.D));
    blocks.packed = packed.data();
#pragma omp parallel
    {
        Scratch sc(pr.D);
        configure_amx_tiles(kTile, 0);
        for (int64_t h = 0; h < pr.Hkv; ++h) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < nblocks; ++u) {
                if (u + 1 < nblocks) prefetch_block(pr, blocks.distinct[u + 1], h);
                pack_block(pr, blocks.distinct[u], h, packed.data() + u * kBlockElems * pr.D);
            }
#pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < items.size(); ++i) run_item(pr, items[i], h, blocks, sc);
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
#endif

}  // extern "C"
