// The CPU kernels of the kernels:: ops (kernels/ops.py holds the schemas), registered with torch's dispatcher
// when kernels/cpu/build.py loads this library: the only binding of the native code. Compiled graphs then
// call them without entering Python. Inputs the native kernels do not cover go on to the ops' portable torch
// implementations, which kernels/ops.py registers as kernels::<op>_portable.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

extern "C" {
int ce_amx_init();
int ce_invariant_attention(int dt, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                           const int32_t* table, int64_t table_stride, const int32_t* cu_q_lens,
                           const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                           float scale, int64_t window, float soft_cap);
int64_t ce_invariant_packed_size(int w_dt, int64_t N, int64_t K);
void ce_invariant_pack(int w_dt, const void* w, void* out, int64_t N, int64_t K);
void ce_invariant_linear(int w_dt, const float* x, const void* packed, const float* bias, void* out, int64_t M,
                         int64_t N, int64_t K);
int ce_dpbf16_available();
int64_t ce_dpbf16_packed_size(int64_t N, int64_t K);
void ce_dpbf16_pack(const void* w, void* out, int64_t N, int64_t K);
void ce_dpbf16_linear(const void* x, const void* packed, const float* bias, void* out, int64_t M, int64_t N, int64_t K);
int ce_compiled_isa();
int ce_packed_linear(int format, int x_dt, const void* x, const uint8_t* w, const float* bias, void* out, int64_t M,
                     int64_t N, int64_t K);
int ce_argmax(int dt, const void* x, int64_t rows, int64_t n, int64_t row_stride, int64_t* out);
void ce_lora_delta(int dt, const void* x, int64_t x_stride, const void* a, const void* b, const int64_t* slots,
                   void* out, int64_t tokens, int64_t S, int64_t W, int64_t K, int64_t N, const int64_t* part_rows,
                   int64_t parts);
int ce_decode_attention(int dt, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                        const int32_t* table, int64_t table_stride, const int32_t* rows_req, const int32_t* seq_lens,
                        void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S, float scale, int64_t window,
                        float soft_cap);
int64_t ce_store_kv(void* k_cache, void* v_cache, const void* k, const void* v, int64_t k_stride, int64_t v_stride,
                    const int64_t* slots, int64_t T, int64_t row, int64_t elem, int64_t S);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
int64_t ce_packed_bf16_size(int64_t N, int64_t K);
void ce_pack_bf16_weight(const void* w, void* out, int64_t N, int64_t K);
void ce_linear_bf16(const void* x, const void* packed, const void* bias, void* out, int64_t M, int64_t N, int64_t K);
int ce_extend_attention_bf16(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                             const int32_t* table, int64_t table_stride, const int32_t* cu_q_lens,
                             const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                             int64_t S, float scale);
int ce_decode_shared_prefix_bf16(const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                                 int64_t table_stride, const int32_t* seq_lens, void* out, int64_t B, int64_t H,
                                 int64_t Hkv, int64_t D, int64_t S, float scale);
#endif
}

namespace {

int dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: return -1;
    }
}

// The portable implementation of an op (kernels::<op>_portable), for the inputs the native kernels decline.
template <typename Signature>
c10::TypedOperatorHandle<Signature> torch_op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

bool amx_ready() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    static const bool ready = ce_amx_init() == 0;
    return ready;
#else
    return false;
#endif
}

// x [T, Hkv, D] with each token's block contiguous (any token stride).
bool token_rows(const at::Tensor& x) { return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2); }

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
    const bool native = k_cache.is_contiguous() && v_cache.is_contiguous() && k.scalar_type() == k_cache.scalar_type() &&
                        v.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type();
    if (!native) {
        static const auto op = torch_op<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kernels::store_kv_portable");
        return op.call(k_cache, v_cache, k, v, slots);
    }
    const at::Tensor kr = token_rows(k) ? k : k.contiguous(), vr = token_rows(v) ? v : v.contiguous();
    const at::Tensor s = slots.to(at::kLong).contiguous();
    const int64_t bad = ce_store_kv(k_cache.data_ptr(), v_cache.data_ptr(), kr.data_ptr(), vr.data_ptr(), kr.stride(0),
                                    vr.stride(0), s.data_ptr<int64_t>(), s.numel(), k_cache.stride(0),
                                    k_cache.element_size(), k_cache.size(0));
    TORCH_CHECK_INDEX(bad == 0, "store_kv: ", bad, " slot(s) out of range for a cache of ", k_cache.size(0), " slots");
}

// attention.cpp's decode kernel: query row b of q [R, H, D] attends to the first lens[b] slots of page-table
// row rows_req[b] (row b when rows_req is undefined); rows of length 0 are zeros.
at::Tensor decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& page_table, const std::optional<at::Tensor>& rows_req, const at::Tensor& lens,
                       double scale, int64_t sliding_window, double soft_cap) {
    const at::Tensor qc = token_rows(q) ? q : q.contiguous();
    const at::Tensor table = page_table.to(at::kInt).contiguous(), lc = lens.to(at::kInt).contiguous();
    at::Tensor out = at::empty(qc.sizes(), qc.options());
    ce_decode_attention(dtype_code(q.scalar_type()), qc.data_ptr(), qc.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                        table.data_ptr<int32_t>(), table.stride(0), rows_req ? rows_req->data_ptr<int32_t>() : nullptr,
                        lc.data_ptr<int32_t>(), out.data_ptr(), qc.size(0), qc.size(1), k_cache.size(1), qc.size(2),
                        k_cache.size(0), static_cast<float>(scale), sliding_window, static_cast<float>(soft_cap));
    return out;
}

// An extend as decode rows: query token j of request b reads table row b with length its position + 1, so it
// gets the bits of a decode step at its position. q [T, H, D], request b's queries cu[b] .. cu[b + 1]; rows
// of no request, and of requests of length 0, are zeros.
at::Tensor extend_as_decodes(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& page_table, const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                             double scale, int64_t sliding_window, double soft_cap) {
    const at::Tensor cu = cu_q_lens.to(at::kInt).contiguous(), lens = seq_lens.to(at::kInt).contiguous();
    const int64_t T = q.size(0), B = lens.numel();
    at::Tensor rows_req = at::zeros({T}, cu.options()), rows_len = at::zeros({T}, cu.options());
    const int32_t *c = cu.data_ptr<int32_t>(), *l = lens.data_ptr<int32_t>();
    int32_t *req = rows_req.data_ptr<int32_t>(), *len = rows_len.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = c[b]; j < c[b + 1] && j < T; ++j) {
            req[j] = static_cast<int32_t>(b);
            len[j] = l[b] > 0 ? l[b] - (c[b + 1] - static_cast<int32_t>(j)) + 1 : 0;
        }
    return decode_rows(q, k_cache, v_cache, page_table, rows_req, rows_len, scale, sliding_window, soft_cap);
}

// Deterministic mode on builds without AVX512 (on AVX512 ones the decode kernel is batch-invariant as it is):
// invariant_attention.cpp's AVX2 FMA chains, an extend's queries computed as decodes in one pass over shared
// K / V rows. q [T, H, D] as extend_as_decodes.
at::Tensor invariant_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& page_table, const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                               double scale, int64_t sliding_window, double soft_cap) {
    const at::Tensor qc = token_rows(q) ? q : q.contiguous();
    const at::Tensor table = page_table.to(at::kInt).contiguous(), cu = cu_q_lens.to(at::kInt).contiguous(),
                     lens = seq_lens.to(at::kInt).contiguous();
    at::Tensor out = at::zeros(qc.sizes(), qc.options());
    ce_invariant_attention(dtype_code(q.scalar_type()), qc.data_ptr(), qc.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                           table.data_ptr<int32_t>(), table.stride(0), cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                           out.data_ptr(), lens.numel(), qc.size(1), k_cache.size(1), qc.size(2), k_cache.size(0),
                           static_cast<float>(scale), sliding_window, static_cast<float>(soft_cap));
    return out;
}

// The native decode kernel is batch-invariant on AVX512 builds (and there serves an extend too, as decode
// rows); elsewhere deterministic mode takes invariant_attention.
constexpr bool kDecodeKernelServesExtend =
#if defined(__AVX512F__)
    true;
#else
    false;
#endif

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                            double soft_cap, bool invariant) {
    const int code = dtype_code(q.scalar_type());
    if (code < 0 || k_cache.scalar_type() != q.scalar_type() || v_cache.scalar_type() != q.scalar_type() ||
        !k_cache.is_contiguous() || !v_cache.is_contiguous()) {
        static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, double, int64_t, double, bool)>("kernels::decode_attention_portable");
        return op.call(q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window, soft_cap, invariant);
    }
    if (invariant && !kDecodeKernelServesExtend)  // a decode step is an extend of one token per row
        return invariant_attention(q, k_cache, v_cache, page_table, at::arange(q.size(0) + 1, seq_lens.options().dtype(at::kInt)),
                                   seq_lens, scale, sliding_window, soft_cap);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    // Rows sharing a cached prefix (radix hits): the shared blocks once for all of them, on AMX.
    if (!invariant && code == 1 && sliding_window <= 0 && soft_cap <= 0 && amx_ready()) {
        const at::Tensor qc = q.contiguous(), table = page_table.to(at::kInt).contiguous(),
                         lens = seq_lens.to(at::kInt).contiguous();
        at::Tensor out = at::empty_like(qc);
        if (ce_decode_shared_prefix_bf16(qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr<int32_t>(),
                                         table.stride(0), lens.data_ptr<int32_t>(), out.data_ptr(), qc.size(0),
                                         qc.size(1), k_cache.size(1), qc.size(2), k_cache.size(0),
                                         static_cast<float>(scale)) == 0)
            return out;
    }
#endif
    return decode_rows(q, k_cache, v_cache, page_table, std::nullopt, seq_lens, scale, sliding_window, soft_cap);
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double soft_cap, bool invariant) {
    const bool typed = dtype_code(q.scalar_type()) >= 0 && k_cache.scalar_type() == q.scalar_type() &&
                       v_cache.scalar_type() == q.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous();
    if (invariant && typed && !kDecodeKernelServesExtend)
        return invariant_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const bool native = !invariant && sliding_window <= 0 && soft_cap <= 0 && q.size(-1) % 64 == 0 && amx_ready() &&
                        q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                        v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous();
    if (native) {
        const at::Tensor qc = token_rows(q) ? q : q.contiguous();
        const at::Tensor table = page_table.to(at::kInt).contiguous(), cu = cu_q_lens.to(at::kInt).contiguous(),
                         lens = seq_lens.to(at::kInt).contiguous();
        at::Tensor out = at::empty(qc.sizes(), qc.options());
        const int64_t covered = cu.data_ptr<int32_t>()[cu.numel() - 1];
        if (covered < qc.size(0)) out.narrow(0, covered, qc.size(0) - covered).zero_();  // rows of no request
        const int bad = ce_extend_attention_bf16(qc.data_ptr(), qc.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                                 table.data_ptr<int32_t>(), table.stride(0), cu.data_ptr<int32_t>(),
                                                 lens.data_ptr<int32_t>(), out.data_ptr(), lens.numel(), qc.size(1),
                                                 k_cache.size(1), qc.size(2), k_cache.size(0), static_cast<float>(scale));
        if (bad == 0) return out;
    }
#endif
    // Without the AMX kernel, decode rows: faster than the portable op's padded SDPA (docs/benchmarks.md).
    if (typed && kDecodeKernelServesExtend)
        return extend_as_decodes(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap);
    static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double, int64_t, double, bool)>(
        "kernels::extend_attention_portable");
    return op.call(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, sliding_window, soft_cap, invariant);
}

// ---- linear --------------------------------------------------------------------------------------------
// torch's plain bf16 linear re-packs the weight into oneDNN's blocked layout on every call, and where the CPU
// has no bf16 GEMM (AVX2-only x86, most ARM) it runs a slow generic loop. So each bf16 weight gets a copy
// made once, by what the CPU has:
//     amx          the panel layout of linear.cpp's AMX kernel (K % 32 == 0)
//     onednn_bf16  oneDNN's own packed layout (what inductor's freezing makes): AVX512-BW/VL/DQ or AVX-NE-CONVERT
//     onednn_fp32  an fp32 copy in oneDNN's packed layout: the product runs in fp32 on upcast inputs and is
//                  rounded to bf16, several times faster there than the bf16 loop (docs/benchmarks.md)
//     blas_fp32    a plain fp32 copy for torch's fp32 GEMM, where oneDNN is not built in
// The copies live here, keyed by the weight's TensorImpl, redone after an in-place change (version counter);
// entries of freed weights are dropped when a new weight is prepared. Memory: the bf16 weights twice over,
// three times with an fp32 copy. The batch-invariant kernel (deterministic mode, bf16 and float32 weights)
// has its own copies, its panels:
//     invariant         invariant_linear.cpp's panels, in the weight's dtype (FMA chains on fp32 inputs)
//     invariant_dpbf16  invariant_linear_dpbf16.cpp's pair-major panels: bf16 weights with even K on a CPU with
//                       AVX512-BF16 (checked once per process; else the FMA kernel)
enum class Kind : int { amx = 0, onednn_bf16 = 1, onednn_fp32 = 2, blas_fp32 = 3, invariant = 4, invariant_dpbf16 = 5 };

struct Prepared {
    Kind kind;
    at::Tensor copy;
};

struct CacheEntry {
    c10::weak_intrusive_ptr<c10::TensorImpl> weight;
    int64_t version;
    Prepared prepared;
};

const auto& reorder_op() {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                               .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
    return op;
}

at::Tensor onednn_linear(const at::Tensor& rows, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 c10::string_view, c10::List<std::optional<at::Scalar>>,
                                                 std::optional<c10::string_view>)>();
    return op.call(rows, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

bool onednn_bf16() {
    static const bool supported = [] {
        if (!at::hasMKLDNN()) return false;
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "")
                                   .typed<bool()>();
        return op.call();
    }();
    return supported;
}

// The bf16 inputs of the start-up checks: rows x [M, K] and a weight [N, K].
at::Tensor check_rows(int64_t M, int64_t K) {
    return at::arange(M * K, at::kFloat).mul(0.11).cos().to(at::kBFloat16).view({M, K});
}

at::Tensor check_weight(int64_t N, int64_t K) {
    return at::arange(N * K, at::kFloat).mul(0.37).sin().to(at::kBFloat16).view({N, K});
}

// A packed bf16 kernel's start-up check, `product(x, out, m)` computing the first m rows of x against the weight
// the caller packed from `w`: the 40-row product, if its first 1, 17 and 33 rows come out bit for bit the same
// when computed alone (nullopt if not).
using RowsProduct = std::function<void(const at::Tensor& x, at::Tensor& out, int64_t m)>;
std::optional<at::Tensor> rows_invariant_product(const at::Tensor& w, const RowsProduct& product) {
    constexpr int64_t M = 40;
    const int64_t N = w.size(0), K = w.size(1);
    const at::Tensor x = check_rows(M, K);
    at::Tensor full = at::empty({M, N}, w.options()), part = at::empty({M, N}, w.options());
    product(x, full, M);
    for (const int64_t m : {1, 17, 33}) {
        product(x, part, m);
        if (std::memcmp(part.data_ptr(), full.data_ptr(), m * N * 2) != 0) return std::nullopt;
    }
    return full;
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Whether the AMX panel kernel gives a row the same bits whatever the number of rows beside it. The ISA
// defines each element of a tile product on its own, and the kernel walks k alike for every row block, so it
// should; checked once per process on this CPU all the same (the kernel was written where it could not
// run): `rows_invariant_product`. Deterministic mode uses the AMX route only when it holds.
bool amx_rows_invariant() {
    static const bool invariant = [] {
        const at::Tensor w = check_weight(64, 64);
        at::Tensor packed = at::empty({ce_packed_bf16_size(64, 64)}, w.options());
        ce_pack_bf16_weight(w.data_ptr(), packed.data_ptr(), 64, 64);
        return rows_invariant_product(w, [&](const at::Tensor& x, at::Tensor& out, int64_t m) {
                   ce_linear_bf16(x.data_ptr(), packed.data_ptr(), nullptr, out.data_ptr(), m, 64, 64);
               }).has_value();
    }();
    return invariant;
}
#endif

// Whether the AVX512-BF16 invariant kernel is built here and gives a row the same bits whatever the number of
// rows beside it, and close to the float32 product (its instruction at work): a 40-row product against its
// first 1, 17 and 33 rows, once per process. Deterministic mode uses it only when this holds, and says so when
// it does not.
bool dpbf16_ready() {
    static const bool ready = [] {
        if (!ce_dpbf16_available()) return false;
        constexpr int64_t N = 112, K = 320;  // a partial panel, two blocks of k
        const at::Tensor w = check_weight(N, K);
        at::Tensor packed = at::empty({ce_dpbf16_packed_size(N, K)}, w.options());
        ce_dpbf16_pack(w.data_ptr(), packed.data_ptr(), N, K);
        const std::optional<at::Tensor> full = rows_invariant_product(w, [&](const at::Tensor& x, at::Tensor& out,
                                                                                int64_t m) {
            ce_dpbf16_linear(x.data_ptr(), packed.data_ptr(), nullptr, out.data_ptr(), m, N, K);
        });
        const bool ok = full.has_value() && at::linear(check_rows(40, K).to(at::kFloat), w.to(at::kFloat))
                                                        .sub(full->to(at::kFloat)).abs().max().item<float>() < 0.5f;
        if (!ok) TORCH_WARN("the AVX512-BF16 invariant linear failed its start-up check: deterministic mode's bf16 "
                            "linears run the FMA kernel instead");
        return ok;
    }();
    return ready;
}

Prepared prepare(const at::Tensor& weight, bool invariant) {
    const at::Tensor w = weight.detach().contiguous();
    const int64_t N = w.size(0), K = w.size(1);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    // Deterministic mode on AMX: the panel kernel for every row count (never handing big GEMMs to oneDNN).
    if (invariant && w.scalar_type() == at::kBFloat16 && amx_ready() && K % 32 == 0 && amx_rows_invariant()) {
        at::Tensor packed = at::empty({ce_packed_bf16_size(N, K)}, w.options());
        ce_pack_bf16_weight(w.data_ptr(), packed.data_ptr(), N, K);
        return {Kind::amx, packed};
    }
#endif
    if (invariant && w.scalar_type() == at::kBFloat16 && K % 2 == 0 && dpbf16_ready()) {
        at::Tensor packed = at::empty({ce_dpbf16_packed_size(N, K)}, w.options());
        ce_dpbf16_pack(w.data_ptr(), packed.data_ptr(), N, K);
        return {Kind::invariant_dpbf16, packed};
    }
    if (invariant) {
        const int w_dt = w.scalar_type() == at::kFloat ? 0 : 1;
        at::Tensor packed = at::empty({ce_invariant_packed_size(w_dt, N, K)}, w.options());
        ce_invariant_pack(w_dt, w.data_ptr(), packed.data_ptr(), N, K);
        return {Kind::invariant, packed};
    }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx_ready() && K % 32 == 0) {
        at::Tensor packed = at::empty({ce_packed_bf16_size(N, K)}, w.options());
        ce_pack_bf16_weight(w.data_ptr(), packed.data_ptr(), N, K);
        return {Kind::amx, packed};
    }
#endif
    (void)N;
    (void)K;
    if (onednn_bf16()) return {Kind::onednn_bf16, reorder_op().call(w, 1)};
    if (at::hasMKLDNN()) return {Kind::onednn_fp32, reorder_op().call(w.to(at::kFloat), 1)};
    return {Kind::blas_fp32, w.to(at::kFloat)};
}

// The prepared copy of a weight (the one cache of them: one map for each mode).
Prepared prepared_weight(const at::Tensor& weight, bool invariant) {
    static std::mutex mutex;
    static std::unordered_map<const c10::TensorImpl*, CacheEntry> caches[2];
    const std::lock_guard<std::mutex> lock(mutex);
    auto& cache = caches[invariant ? 1 : 0];
    const c10::TensorImpl* key = weight.unsafeGetTensorImpl();
    const int64_t version = weight.is_inference() ? -1 : static_cast<int64_t>(weight._version());
    auto it = cache.find(key);
    if (it != cache.end() && !it->second.weight.expired() && it->second.version == version) return it->second.prepared;
    for (auto e = cache.begin(); e != cache.end();) e = e->second.weight.expired() ? cache.erase(e) : std::next(e);
    Prepared prepared = prepare(weight, invariant);
    cache.insert_or_assign(key, CacheEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), version,
                                           prepared});
    return prepared;
}

// Deterministic mode: every row's result independent of the batch (invariant_linear.cpp).
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    const int64_t K = x.size(-1), N = weight.size(0);
    const Prepared p = prepared_weight(weight, true);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (p.kind == Kind::amx) {
        const at::Tensor xb = x.reshape({-1, K}).contiguous();
        const at::Tensor bb = bias.has_value() ? bias->contiguous() : at::Tensor();
        at::Tensor out = at::empty({xb.size(0), N}, x.options());
        if (xb.size(0) > 0)
            ce_linear_bf16(xb.data_ptr(), p.copy.data_ptr(), bb.defined() ? bb.data_ptr() : nullptr, out.data_ptr(),
                           xb.size(0), N, K);
        return out.view(shape);
    }
#endif
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    if (p.kind == Kind::invariant_dpbf16) {  // x is bf16, as the weight (linear() checks)
        const at::Tensor xb = x.reshape({-1, K}).contiguous();
        at::Tensor out = at::empty({xb.size(0), N}, x.options());
        if (xb.size(0) > 0)
            ce_dpbf16_linear(xb.data_ptr(), p.copy.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr,
                             out.data_ptr(), xb.size(0), N, K);
        return out.view(shape);
    }
    const at::Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
    at::Tensor out = at::empty({rows.size(0), N}, x.options());
    ce_invariant_linear(weight.scalar_type() == at::kFloat ? 0 : 1, rows.data_ptr<float>(), p.copy.data_ptr(),
                        b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr(), rows.size(0), N, K);
    return out.view(shape);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool invariant) {
    const int64_t K = x.size(-1);
    if (invariant) {
        const at::ScalarType t = weight.scalar_type();
        const bool covered = (t == at::kFloat || t == at::kBFloat16) && x.scalar_type() == t && weight.dim() == 2 &&
                             weight.size(1) == K && (!bias.has_value() || bias->scalar_type() == t);
        if (covered) return invariant_linear(x, weight, bias);
        // other dtypes (float16, mixed): the portable invariant linear, one row at a time
        static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                   bool)>("kernels::linear_portable");
        return op.call(x, weight, bias, true);
    }
    const bool bf16 = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                      weight.size(1) == K && (!bias.has_value() || bias->scalar_type() == at::kBFloat16);
    if (!bf16) return at::linear(x, weight, bias);
    const int64_t N = weight.size(0);
    const Prepared p = prepared_weight(weight, false);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    const at::Tensor rows = x.reshape({-1, K}).contiguous();
    switch (p.kind) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
        case Kind::amx: {
            // Big GEMMs go to torch's own (oneDNN on AMX), which blocks them better than the panel kernel
            // (docs/benchmarks.md, "CPU bf16 linear, big GEMMs"); the panel kernel keeps up to 512 rows.
            const int64_t M = rows.size(0);
            if (M >= 2048 || (M >= 768 && N >= 1024)) return at::linear(x, weight, bias);
            at::Tensor out = at::empty({M, N}, x.options());
            const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
            if (M > 0)
                ce_linear_bf16(rows.data_ptr(), p.copy.data_ptr(), b.defined() ? b.data_ptr() : nullptr, out.data_ptr(),
                               M, N, K);
            return out.view(shape);
        }
#endif
        case Kind::onednn_bf16:
            return onednn_linear(rows, p.copy, bias).view(shape);
        case Kind::onednn_fp32: {
            const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
            return onednn_linear(rows.to(at::kFloat), p.copy, b).to(at::kBFloat16).view(shape);
        }
        default: {
            const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
            return at::linear(rows.to(at::kFloat), p.copy, b).to(at::kBFloat16).view(shape);
        }
    }
}

// ---- packed (block-quantized) weights --------------------------------------------------------------------
// bf16 activations: packed_linear.cpp on the file's layout, packed_linear_x16.cpp on 16 rows interleaved
// (activations quantized per row and block of 32; batch-invariant, so `invariant` changes nothing). Everything else (float32 activations: exact, in fp32) goes to the portable op.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t in_features,
                         const std::optional<at::Tensor>& bias, bool invariant) {
    const int64_t K = in_features;
    const bool covered = x.scalar_type() == at::kBFloat16 && x.size(-1) == K && K % 32 == 0 &&
                         blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous();
    static const auto portable =
        torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const std::optional<at::Tensor>&,
                            bool)>("kernels::linear_packed_portable");
    if (!covered) return portable.call(x, blocks, format, in_features, bias, invariant);
    const int64_t N = blocks.size(0) * (format >= 16 ? 16 : 1);  // an interleaved format: groups of 16 rows
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    const at::Tensor rows = x.reshape({-1, K}).contiguous();
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor out = at::empty({rows.size(0), N}, x.options());
    if (rows.size(0) > 0 &&
        ce_packed_linear(static_cast<int>(format), 1, rows.data_ptr(), blocks.data_ptr<uint8_t>(),
                         b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr(), rows.size(0), N, K) != 0)
        return portable.call(x, blocks, format, in_features, bias, invariant);
    return out.view(shape);
}

// ---- greedy argmax ----------------------------------------------------------------------------------------
at::Tensor argmax(const at::Tensor& x) {
    const int code = dtype_code(x.scalar_type());
    if (code < 0 || x.dim() != 2 || x.size(1) == 0) return at::argmax(x, -1);
    const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({rows.size(0)}, x.options().dtype(at::kLong));
    ce_argmax(code, rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), out.data_ptr<int64_t>());
    return out;
}

// ---- LoRA delta ------------------------------------------------------------------------------------------
// lora.cpp's grouped GEMM over the slot buffers (float32 or bf16, one dtype throughout; B as the slots store
// it, [S, W, N], which the op sees transposed); anything else goes to the portable op.
at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots,
                      at::IntArrayRef part_rows) {
    const auto dt = x.scalar_type();
    const int64_t parts = static_cast<int64_t>(part_rows.size()) - 1;
    const at::Tensor bt = b.transpose(1, 2);
    const bool covered = (dt == at::kFloat || dt == at::kBFloat16) && a.scalar_type() == dt &&
                         b.scalar_type() == dt && x.dim() == 2 && x.stride(1) == 1 && a.dim() == 3 &&
                         b.dim() == 3 && a.is_contiguous() && bt.is_contiguous() && a.size(2) == x.size(1) &&
                         a.size(0) == b.size(0) && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                         slots.numel() == x.size(0) && parts >= 1 && a.size(1) % parts == 0 &&
                         b.size(2) == a.size(1) && a.size(0) > 0 && part_rows.front() == 0 &&
                         part_rows.back() == b.size(1) &&
                         std::is_sorted(part_rows.begin(), part_rows.end());
    static const auto portable =
        torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            at::IntArrayRef)>("kernels::lora_delta_portable");
    if (!covered) return portable.call(x, a, b, slots, part_rows);
    const int64_t S = a.size(0);
    const int64_t* ids = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.numel(); ++t)
        TORCH_CHECK(-S <= ids[t] && ids[t] < S, "lora_delta: slot ", ids[t], " outside the ", S, " slots");
    at::Tensor out = at::empty({x.size(0), b.size(1)}, x.options());
    const std::vector<int64_t> rows(part_rows.begin(), part_rows.end());
    ce_lora_delta(dt == at::kFloat ? 0 : 1, x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(),
                  slots.data_ptr<int64_t>(), out.data_ptr(), x.size(0), a.size(0), a.size(1), x.size(1),
                  b.size(1), rows.data(), parts);
    return out;
}

// Bits: 0 AVX512F, 1 AVX512-BF16, 2 AMX-BF16 (what this build targets: what COMPILED_ENGINE_CPU_ISA left
// on), 3 AMX tiles granted to this process (the AMX kernels run).
int64_t native_isa() { return ce_compiled_isa() | (amx_ready() ? 8 : 0); }

// Which route kernels::linear takes for this weight (the Kind above: tests and benchmarks read it).
int64_t linear_route(const at::Tensor& weight, bool invariant) {
    return static_cast<int64_t>(prepared_weight(weight, invariant).kind);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kernels, m) {
    m.def("native_isa() -> int", &native_isa);
    m.def("linear_route(Tensor weight, bool invariant) -> int", &linear_route);
}

TORCH_LIBRARY_IMPL(kernels, CPU, m) {
    m.impl("store_kv", store_kv);
    m.impl("decode_attention", decode_attention);
    m.impl("extend_attention", extend_attention);
    m.impl("linear", linear);
    m.impl("argmax", argmax);
    m.impl("linear_packed", linear_packed);
    m.impl("lora_delta", lora_delta);
}
