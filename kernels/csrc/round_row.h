// fp32 sums to a layer's output dtype, plus its bias read in its own dtype: shared by the
// linear-layer kernels (gemv_common.cpp, bf16_batch_linear.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vlmserve {

#if defined(__AVX512F__) && !defined(__AVX512BF16__)
// 16 fp32 values to bf16, rounded to nearest even as c10's (a NaN to its quiet NaN): the
// integer form of what AVX512-BF16's vcvtneps2bf16 does
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
#elif defined(__AVX2__)
// 8 fp32 values to bf16, rounded as above
inline __m128i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32-bit lanes to 16: packed within each 128-bit half, then the halves' low words joined
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0b1000);
  return _mm256_castsi256_si128(packed);
}
#endif

// One row of N fp32 sums plus the bias, in the output's dtype: one plain loop, the bias read
// in its own dtype (the layer's or fp32), rather than ATen's add and conversion (two ops
// and a converted bias per call: per layer and step in a decode).
template <typename out_t, typename bias_t>
inline void round_row(const float* acc, const bias_t* bias, out_t* out, int64_t N) {
  int64_t n = 0;
#if defined(__AVX512F__)
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
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), (__m256i)_mm512_cvtneps_pbh(v));
#else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), round_to_bf16(v));
#endif
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<out_t, at::BFloat16>) {  // 8 at a time, rounded as c10's
    for (; n + 8 <= N; n += 8) {
      __m256 v = _mm256_loadu_ps(acc + n);
      if (bias) {
        if constexpr (std::is_same_v<bias_t, float>) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
        } else {
          const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bias + n));
          v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b16), 16)));
        }
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + n), round_to_bf16(v));
    }
  }
#endif
  for (; n < N; ++n) out[n] = static_cast<out_t>(acc[n] + (bias ? static_cast<float>(bias[n]) : 0.f));
}

}  // namespace vlmserve
