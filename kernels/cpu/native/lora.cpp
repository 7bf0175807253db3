// LoRA adapters' batched delta (kernels::lora_delta on the CPU), read straight from the slot buffers:
// no gathered copy of any adapter. Token t with slot s (-1: no adapter, zeros) gets h = A[s] x_t
// (float32 dot products over K), then out_t[n] = sum over r of B[s][n][r] h[r], over the r of the
// projection that row n belongs to (`part_rows`: B is block-diagonal by projection, q / k / v or gate /
// up), rounded once. Each token's result comes from its own row and adapter alone, in one fixed order:
// batch-invariant, and the same bits in a decode row and an extend row.

#include <omp.h>

#include <vector>

#include "common.h"

namespace {

template <class E>
void lora_rows(const typename E::T* x, int64_t x_stride, const typename E::T* a,
               const typename E::T* b, const int64_t* slots, typename E::T* out, int64_t tokens,
               int64_t width, int64_t K, int64_t N, const int64_t* part_rows, int64_t parts) {
    using T = typename E::T;
    const int64_t R = width / parts;
#pragma omp parallel
    {
        std::vector<float> h(width);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            T* o = out + t * N;
            const int64_t s = slots[t];
            if (s < 0) {
                for (int64_t n = 0; n < N; ++n) o[n] = E::store(0.0f);
                continue;
            }
            const T* xt = x + t * x_stride;
            const T* as = a + s * width * K;
            for (int64_t r = 0; r < width; ++r) {
                const T* ar = as + r * K;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; ++k) acc += E::load(xt[k]) * E::load(ar[k]);
                h[r] = acc;
            }
            const T* bs = b + s * N * width;
            for (int64_t p = 0; p < parts; ++p) {
                const float* hp = h.data() + p * R;
                for (int64_t n = part_rows[p]; n < part_rows[p + 1]; ++n) {
                    const T* bn = bs + n * width + p * R;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t r = 0; r < R; ++r) acc += E::load(bn[r]) * hp[r];
                    o[n] = E::store(acc);
                }
            }
        }
    }
}

}  // namespace

// dt: 0 float32, 1 bfloat16; x [tokens, K] rows `x_stride` apart, a [S, width, K], b [S, N, width],
// out [tokens, N] contiguous; part_rows: parts + 1 row boundaries of B's projections.
extern "C" void ce_lora_delta(int dt, const void* x, int64_t x_stride, const void* a, const void* b,
                              const int64_t* slots, void* out, int64_t tokens, int64_t width, int64_t K,
                              int64_t N, const int64_t* part_rows, int64_t parts) {
    if (dt == 0) {
        lora_rows<F32>(static_cast<const float*>(x), x_stride, static_cast<const float*>(a),
                       static_cast<const float*>(b), slots, static_cast<float*>(out), tokens, width, K, N,
                       part_rows, parts);
    } else {
        lora_rows<BF16>(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(a),
                        static_cast<const uint16_t*>(b), slots, static_cast<uint16_t*>(out), tokens, width,
                        K, N, part_rows, parts);
    }
}
