// bf16 linear on AMX tiles: the kernel behind kernels::linear (torch_ops.cpp) where the build targets AMX.

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

namespace {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// bf16 linear on AMX tiles. The weight [N, K] is packed once into panels of 64 output columns; panel p holds,
// for each pair of input features kk, the 64 columns' two values (256 bytes): rows of an AMX B tile (16
// pairs x 16 columns) are then 256 bytes apart, and each panel is one sequential stream. Decode is bound by
// reading the weights: this streams them faster than oneDNN's packed GEMV (docs/benchmarks.md).
constexpr int64_t kPanel = 64;

// Tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5-7: B (16 pairs x 16 columns).
void configure_tiles(int rows) { configure_amx_tiles(rows, 5); }

void pack_bf16_weight(const uint16_t* w, uint16_t* out, int64_t N, int64_t K) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kk = 0; kk < K / 2; ++kk)
            for (int64_t c = 0; c < kPanel; ++c) {
                const int64_t n = p * kPanel + c;
                uint16_t* dst = out + ((p * (K / 2) + kk) * kPanel + c) * 2;
                dst[0] = n < N ? w[n * K + 2 * kk] : 0;
                dst[1] = n < N ? w[n * K + 2 * kk + 1] : 0;
            }
}

// out[0:cols] = bf16(c[0:cols] + bias[0:cols]), rounding to nearest even like torch; bias may be null.
inline void store_bf16_row(const float* c, const uint16_t* bias, uint16_t* out, int64_t cols) {
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 m = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, c + j);
        if (bias) v = _mm512_add_ps(v, load16_bf16(_mm256_maskz_loadu_epi16(m, bias + j)));
        _mm256_mask_storeu_epi16(out + j, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// c [32, 64] = x rows [m0, m0 + 32) @ the panel w: two 32-column halves, each as 2 x 2 tiles (A: tiles 4-5,
// B: 6-7, C: 0-3), one tile load per product where 16-row blocks need 1.25.
inline void block32(const uint16_t* x, const uint16_t* w, int64_t m0, int64_t K, float* c) {
    for (int64_t half = 0; half < 2; ++half) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < K / 32; ++kb) {
            const uint16_t* b = w + kb * 16 * 2 * kPanel + half * 64;
            _tile_loadd(4, x + m0 * K + kb * 32, K * 2);
            _tile_loadd(6, b, 4 * kPanel);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 32, 4 * kPanel);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, x + (m0 + 16) * K + kb * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        float* ch = c + half * 32;
        _tile_stored(0, ch, 4 * kPanel);
        _tile_stored(1, ch + 16, 4 * kPanel);
        _tile_stored(2, ch + 16 * kPanel, 4 * kPanel);
        _tile_stored(3, ch + 16 * kPanel + 16, 4 * kPanel);
    }
}

// out [M, N] = x [M, K] @ w.T (+ bias), all bf16 with float32 accumulation; K % 32 == 0. Threads split the
// panels; each panel runs its rows in blocks of 32 (then 16), the panel staying in L2 between blocks.
void linear_bf16(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* out, int64_t M,
                 int64_t N, int64_t K) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel
    {
        int configured = -1;
        alignas(64) float c[32 * kPanel];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint16_t* w = packed + p * K * kPanel;
            const int64_t n0 = p * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
            int64_t m0 = 0;
            for (; m0 + 32 <= M; m0 += 32) {
                if (configured != 16) configure_tiles(configured = 16);
                block32(x, w, m0, K, c);
                for (int r = 0; r < 32; ++r) store_bf16_row(c + r * kPanel, bias ? bias + n0 : nullptr, out + (m0 + r) * N + n0, cols);
            }
            for (; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? static_cast<int>(M - m0) : 16;
                if (rows != configured) configure_tiles(configured = rows);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < K / 32; ++kb) {
                    const uint16_t* b = w + kb * 16 * 2 * kPanel;
                    _tile_loadd(4, x + m0 * K + kb * 32, K * 2);
                    _tile_loadd(5, b, 4 * kPanel);
                    _tile_loadd(6, b + 32, 4 * kPanel);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(7, b + 64, 4 * kPanel);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(5, b + 96, 4 * kPanel);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, c, 4 * kPanel);
                _tile_stored(1, c + 16, 4 * kPanel);
                _tile_stored(2, c + 32, 4 * kPanel);
                _tile_stored(3, c + 48, 4 * kPanel);
                for (int r = 0; r < rows; ++r) store_bf16_row(c + r * kPanel, bias ? bias + n0 : nullptr, out + (m0 + r) * N + n0, cols);
            }
        }
        if (configured >= 0) _tile_release();
    }
}
#endif

}  // namespace

extern "C" {

// The ISA extensions this build targets (bit 0 AVX512F, bit 1 AVX512-BF16, bit 2 AMX-BF16): what
// COMPILED_ENGINE_CPU_ISA left on (kernels/cpu/isa.py).
int ce_compiled_isa() {
    int mask = 0;
#if defined(__AVX512F__)
    mask |= 1;
#endif
#if defined(__AVX512BF16__)
    mask |= 2;
#endif
#if defined(__AMX_BF16__)
    mask |= 4;
#endif
    return mask;
}

// 0 when this build and this process can use AMX bf16 tiles (asks Linux for the tile state once).
int ce_amx_init() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return static_cast<int>(syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata));
#else
    return -1;
#endif
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
int64_t ce_packed_bf16_size(int64_t N, int64_t K) { return (N + kPanel - 1) / kPanel * kPanel * K; }

void ce_pack_bf16_weight(const void* w, void* out, int64_t N, int64_t K) {
    pack_bf16_weight(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), N, K);
}

void ce_linear_bf16(const void* x, const void* packed, const void* bias, void* out, int64_t M, int64_t N, int64_t K) {
    linear_bf16(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias),
                static_cast<uint16_t*>(out), M, N, K);
}
#endif

}  // extern "C"
