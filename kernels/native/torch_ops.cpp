// The CPU kernels of kernels::store_kv, decode_attention, extend_attention and cpu_linear, registered with
// torch's dispatcher when kernels/cpu_native.py loads this library. Compiled graphs (inductor's C++
// wrapper) then call them without entering Python, which cost ~20 us per call through a Python kernel.
// Inputs the native kernels do not cover go on to the ops' torch implementations, which kernels/ops.py
// registers as kernels::<op>_torch.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_map>

extern "C" {
int ce_amx_init();
int ce_decode_attention(int dt, const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                        int64_t table_stride, const int32_t* seq_lens, void* out, int64_t B, int64_t H, int64_t Hkv,
                        int64_t D, int64_t S, float scale, int64_t window, float soft_cap);
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

// The torch implementation of `op` (kernels::<op>_torch), for the inputs the native kernels decline.
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
        static const auto op = torch_op<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kernels::store_kv_torch");
        return op.call(k_cache, v_cache, k, v, slots);
    }
    const at::Tensor kr = token_rows(k) ? k : k.contiguous(), vr = token_rows(v) ? v : v.contiguous();
    const at::Tensor s = slots.to(at::kLong).contiguous();
    const int64_t bad = ce_store_kv(k_cache.data_ptr(), v_cache.data_ptr(), kr.data_ptr(), vr.data_ptr(), kr.stride(0),
                                    vr.stride(0), s.data_ptr<int64_t>(), s.numel(), k_cache.stride(0),
                                    k_cache.element_size(), k_cache.size(0));
    TORCH_CHECK_INDEX(bad == 0, "store_kv: ", bad, " slot(s) out of range for a cache of ", k_cache.size(0), " slots");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale, int64_t page_size,
                            int64_t sliding_window, double soft_cap) {
    const int code = dtype_code(q.scalar_type());
    if (code < 0 || k_cache.scalar_type() != q.scalar_type() || v_cache.scalar_type() != q.scalar_type() ||
        !k_cache.is_contiguous() || !v_cache.is_contiguous()) {
        static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, double, int64_t, int64_t, double)>("kernels::decode_attention_torch");
        return op.call(q, k_cache, v_cache, page_table, seq_lens, scale, page_size, sliding_window, soft_cap);
    }
    const at::Tensor qc = q.contiguous(), table = page_table.to(at::kInt).contiguous(), lens = seq_lens.to(at::kInt).contiguous();
    at::Tensor out = at::empty_like(qc);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    // Rows sharing a cached prefix (radix hits): the shared blocks once for all of them, on AMX.
    if (code == 1 && sliding_window <= 0 && soft_cap <= 0 && amx_ready() &&
        ce_decode_shared_prefix_bf16(qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr<int32_t>(),
                                     table.stride(0), lens.data_ptr<int32_t>(), out.data_ptr(), qc.size(0), qc.size(1),
                                     k_cache.size(1), qc.size(2), k_cache.size(0), static_cast<float>(scale)) == 0)
        return out;
#endif
    ce_decode_attention(code, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr<int32_t>(),
                        table.stride(0), lens.data_ptr<int32_t>(), out.data_ptr(), qc.size(0), qc.size(1),
                        k_cache.size(1), qc.size(2), k_cache.size(0), static_cast<float>(scale), sliding_window,
                        static_cast<float>(soft_cap));
    return out;
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                            double scale, int64_t page_size, int64_t sliding_window, double soft_cap) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const bool native = sliding_window <= 0 && soft_cap <= 0 && q.size(-1) % 64 == 0 && amx_ready() &&
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
    static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, double)>(
        "kernels::extend_attention_torch");
    return op.call(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, page_size, sliding_window, soft_cap);
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX panel copies of bf16 weights, made on first use and again after an in-place change (version counter);
// entries of freed weights are dropped when a new weight is packed.
struct PackedWeight {
    c10::weak_intrusive_ptr<c10::TensorImpl> weight;
    int64_t version;
    at::Tensor packed;
};

at::Tensor packed_weight(const at::Tensor& weight) {
    static std::mutex mutex;
    static std::unordered_map<const c10::TensorImpl*, PackedWeight> cache;
    const std::lock_guard<std::mutex> lock(mutex);
    const c10::TensorImpl* key = weight.unsafeGetTensorImpl();
    const int64_t version = weight._version();
    auto it = cache.find(key);
    if (it != cache.end() && !it->second.weight.expired() && it->second.version == version) return it->second.packed;
    for (auto e = cache.begin(); e != cache.end();) e = e->second.weight.expired() ? cache.erase(e) : std::next(e);
    const int64_t N = weight.size(0), K = weight.size(1);
    const at::Tensor w = weight.contiguous();
    at::Tensor packed = at::empty({ce_packed_bf16_size(N, K)}, weight.options());
    ce_pack_bf16_weight(w.data_ptr(), packed.data_ptr(), N, K);
    cache.insert_or_assign(key, PackedWeight{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), version, packed});
    return packed;
}
#endif

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const int64_t K = x.size(-1);
    const bool native = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                        weight.size(1) == K && K % 32 == 0 && !weight.is_inference() && amx_ready() &&
                        (!bias.has_value() || bias->scalar_type() == at::kBFloat16);
    const int64_t M = K > 0 ? x.numel() / K : 0, N = weight.size(0);
    // Big GEMMs go to torch's own (oneDNN on AMX), which blocks them better than the panel kernel. Median
    // TFLOP/s, the two timed alternately in one process (this kernel vs oneDNN, 2 runs): M 1056, N x K
    // 4096 x 768: 1.32 / 1.18 vs 1.84 / 1.62; 1280 x 768: 1.09 / 1.30 vs 1.23 / 1.64; M 2048-8192: oneDNN
    // 1.1-1.6x in 7 of 8 shapes. The panel kernel keeps N = 768 at 1056 rows (0.98 / 1.23 vs 0.68 / 0.81)
    // and everything up to 512 rows, where it is ahead or even.
    if (native && (M >= 2048 || (M >= 768 && N >= 1024))) return at::linear(x, weight, bias);
    if (native) {
        const at::Tensor packed = packed_weight(weight);
        const at::Tensor rows = x.reshape({-1, K}).contiguous();
        at::Tensor out = at::empty({rows.size(0), N}, x.options());
        const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
        if (rows.size(0) > 0)
            ce_linear_bf16(rows.data_ptr(), packed.data_ptr(), b.defined() ? b.data_ptr() : nullptr, out.data_ptr(),
                           rows.size(0), N, K);
        std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
        shape.back() = N;
        return out.view(shape);
    }
#endif
    static const auto op = torch_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
        "kernels::cpu_linear_torch");
    return op.call(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernels, CPU, m) {
    m.impl("store_kv", store_kv);
    m.impl("decode_attention", decode_attention);
    m.impl("extend_attention", extend_attention);
    m.impl("cpu_linear", cpu_linear);
}
