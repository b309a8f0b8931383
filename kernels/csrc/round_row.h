// fp32 sums to a layer's output dtype, plus its bias read in its own dtype: shared by the
// linear-layer kernels (gemv.cpp, bf16_batch_linear.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace vlmserve {

// One row of N fp32 sums plus the bias, in the output's dtype: one plain loop, the bias read
// in its own dtype (the layer's or fp32), rather than ATen's add and conversion (two ops
// and a converted bias per call: per layer and step in a decode).
template <typename out_t, typename bias_t>
inline void round_row(const float* acc, const bias_t* bias, out_t* out, int64_t N) {
  int64_t n = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<out_t, at::BFloat16>) {  // 16 at a time, rounded to nearest even as c10's
    for (; n + 16 <= N; n += 16) {
      __m512 v = _mm512_loadu_ps(acc + n);
      if (bias) {
        if constexpr (std::is_same_v<bias_t, float>) {
          v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
        } else {
          const __m256i b16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n));
          v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16)));
        }
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
#endif
  for (; n < N; ++n) out[n] = static_cast<out_t>(acc[n] + (bias ? static_cast<float>(bias[n]) : 0.f));
}

}  // namespace vlmserve
