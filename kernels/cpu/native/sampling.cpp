// Greedy sampling on the CPU: the row-wise argmax of the logits (kernels::argmax, torch_ops.cpp): one
// vectorized pass per row, where torch's CPU argmax is several times slower on bf16 logits (docs/benchmarks.md).

#include <omp.h>

#include "common.h"

namespace {

// Index of the first maximum of x[0:n], or of the first NaN if there is one: what torch.argmax returns.
template <typename E>
int64_t argmax_row(const typename E::T* x, int64_t n) {
    int64_t i = 0, best = 0;
    float best_value = n > 0 ? E::load(x[0]) : 0.0f;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 values = load16(x);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = index;
        if (const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q)) return __builtin_ctz(nan);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = load16(x + i);
            at = _mm512_add_epi32(at, step);
            if (const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return i + __builtin_ctz(nan);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, values, _CMP_GT_OQ);  // ties keep the earlier index
            values = _mm512_mask_mov_ps(values, greater, v);
            index = _mm512_mask_mov_epi32(index, greater, at);
        }
        best_value = _mm512_reduce_max_ps(values);
        const __mmask16 top = _mm512_cmp_ps_mask(values, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(top, index);
    }
#endif
    for (; i < n; ++i) {
        const float v = E::load(x[i]);
        if (v != v) return i;
        if (v > best_value) {
            best_value = v;
            best = i;
        }
    }
    return best;
}

template <typename E>
void argmax_rows(const typename E::T* x, int64_t rows, int64_t n, int64_t row_stride, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row<E>(x + r * row_stride, n);
}

}  // namespace

extern "C" {

int ce_argmax(int dt, const void* x, int64_t rows, int64_t n, int64_t row_stride, int64_t* out) {
    switch (dt) {
        case 0: argmax_rows<F32>(static_cast<const float*>(x), rows, n, row_stride, out); return 0;
        case 1: argmax_rows<BF16>(static_cast<const uint16_t*>(x), rows, n, row_stride, out); return 0;
        case 2: argmax_rows<F16>(static_cast<const _Float16*>(x), rows, n, row_stride, out); return 0;
        default: return -1;
    }
}

}  // extern "C"
