// A grammar's token bitmask applied to the logits in place: bit j of word w allowed token
// 32w + j; every other token's logit becomes -inf. A JSON grammar allows few tokens at a
// time, so most words are 0; with AVX-512 each word is two masked stores of -inf, and an
// all-ones word is skipped. One row per task.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be a contiguous fp32 [rows, vocab] tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2, "bitmask must be int32 [n, words]");
  const at::Tensor rows_c = rows.to(at::kLong).contiguous();
  const at::Tensor mask_c = bitmask.contiguous();
  const int64_t n = rows_c.numel(), vocab = logits.size(1), words = mask_c.size(1);
  TORCH_CHECK(mask_c.size(0) == n, "one bitmask row per logits row");
  float* lp = logits.data_ptr<float>();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int32_t* mp = mask_c.data_ptr<int32_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * vocab;
      const int32_t* mask = mp + i * words;
      const int64_t full_words = std::min(words, vocab / 32);
      for (int64_t w = 0; w < full_words; ++w) {
        const uint32_t word = static_cast<uint32_t>(mask[w]);
        if (word == 0xFFFFFFFFu) continue;
        float* out = row + w * 32;
#ifdef __AVX512F__
        // two masked stores: -inf into the lanes whose bit is clear
        const __m512 inf = _mm512_set1_ps(neg_inf);
        _mm512_mask_storeu_ps(out, static_cast<__mmask16>(~word & 0xFFFFu), inf);
        _mm512_mask_storeu_ps(out + 16, static_cast<__mmask16>(~word >> 16), inf);
#else
        for (int j = 0; j < 32; ++j) out[j] = ((word >> j) & 1u) ? out[j] : neg_inf;
#endif
      }
      for (int64_t t = full_words * 32; t < vocab; ++t) {  // the tail, and tokens past the mask
        const int64_t w = t / 32;
        const bool allowed = w < words && ((static_cast<uint32_t>(mask[w]) >> (t % 32)) & 1u);
        if (!allowed) row[t] = neg_inf;
      }
    }
  });
}

}  // namespace

VLMSERVE_EXPORT(apply_token_bitmask);
