// Paged attention over FP8 KV caches (float8 e4m3fn, kv_fp8.h), and their write. The same
// work items and block steps as caches in the queries' dtype (paged_attention_items.h):
// each block of a head is widened into the thread's scratch as it is reached (exactly: in
// the queries' dtype, bf16 pairs for AVX512-BF16's dot products), so the memory read is
// half of bf16's; the keys' scale rides on the scores' scale, the values' on the outputs.
// Compiled apart from paged_attention.cpp (the builds of its instantiations run side by side).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kv_fp8.h"
#include "paged_attention_items.h"

namespace vlmserve::paged {

void attend_fp8(const Call& c) {
  using vlmserve::fp8::Fp8;
  switch (c.q.scalar_type()) {
    case at::kFloat: return dispatch<float, Fp8>(c);
    case at::kBFloat16: return dispatch<c10::BFloat16, Fp8>(c);
    case at::kHalf: return dispatch<c10::Half, Fp8>(c);
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", c.q.scalar_type());
  }
}

// write_kv_cache's FP8 caches: each value divided by its scale, rounded and saturated
void write_kv_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        const int64_t* slots, double k_scale, double v_scale) {
  using vlmserve::fp8::Fp8;
  using vlmserve::fp8::quantize;
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), bs = k_cache.size(3);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache_fp8", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    Fp8* kcp = k_cache.data_ptr<Fp8>();
    Fp8* vcp = v_cache.data_ptr<Fp8>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* kt = kp + (t * heads + h) * dim;
          const scalar_t* vt = vp + (t * heads + h) * dim;
          Fp8* kb = kcp + (block * heads + h) * dim * bs + off * 2;  // [D / 2, bs, 2]
          Fp8* vb = vcp + ((block * heads + h) * (bs / 2) + off / 2) * dim * 2 + (off & 1);  // [bs / 2, D, 2]
          for (int64_t d = 0; d < dim; ++d) {
            kb[(d / 2) * bs * 2 + (d & 1)] = quantize(static_cast<float>(kt[d]), ks);
            vb[d * 2] = quantize(static_cast<float>(vt[d]), vs);
          }
        }
      }
    });
  });
}

}  // namespace vlmserve::paged
