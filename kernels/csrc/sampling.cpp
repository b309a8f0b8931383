// apply_token_bitmask: a grammar's token bitmask applied to the logits in place: bit j of
// word w allowed token 32w + j; every other token's logit becomes -inf. A JSON grammar
// allows few tokens at a time, so most words are 0; with AVX-512 each word is two masked
// stores of -inf, and an all-ones word is skipped. One row per task.
//
// argmax_rows: greedy decoding's tokens, each row's first index of its largest logit (a NaN
// counts as the largest, as in torch.argmax), from the head's bf16 logits as they are or from
// fp32 ones. At 32 rows of a 151,936-token vocabulary, the fp32 copy and torch's argmax over
// it took ~10 ms on a 2-core Xeon, a third of what the head's matmul takes; here one pass
// finds the row's maximum, a second its first index, rows in parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstring>

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

inline float logit(const float* row, int64_t i) { return row[i]; }
inline float logit(const uint16_t* row, int64_t i) {  // bf16: its bits are an fp32's top half
  const uint32_t bits = static_cast<uint32_t>(row[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 top = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(row + i);
    top = _mm256_max_ps(top, x);  // a NaN lane goes its own way: caught by `unordered`
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (const float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < n; ++i) {
    const float x = logit(row, i);
    nan |= x != x;
    best = std::max(best, x);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (logit(row, j) != logit(row, j)) return j;
  }
  i = 0;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + i), target, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < n; ++i)
    if (logit(row, i) == best) return i;
  return 0;  // every logit -inf: the first, as torch's
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: fp32 or bf16 logits [rows, vocab]");
  const at::Tensor rows = logits.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty({n}, rows.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  const void* base = rows.data_ptr();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = bf16 ? row_argmax(static_cast<const uint16_t*>(base) + r * vocab, vocab)
                   : row_argmax(static_cast<const float*>(base) + r * vocab, vocab);
  });
  return out;
}

}  // namespace

VLMSERVE_EXPORT(apply_token_bitmask);
VLMSERVE_EXPORT(argmax_rows);
