// An FP8 KV cache's values (float8 e4m3fn, one byte each, in the caches' usual layouts):
// written as x / scale rounded to the nearest e4m3 value, ties to even, and saturated at
// +-448 (vLLM's cache write: a key past the range is kept at its largest value, not made
// a NaN); read back widened exactly (every e4m3 value is a bf16, fp16 and fp32 value) and
// multiplied by the scale, which the kernels fold into the scores' scale and the outputs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace vlmserve::fp8 {

using Fp8 = c10::Float8_e4m3fn;
constexpr float kMax = 448.f;  // the largest finite e4m3 value

inline Fp8 quantize(float x, float scale) {
  const float y = x / scale;
  return Fp8(std::isnan(y) ? y : std::min(std::max(y, -kMax), kMax));
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight e4m3 bytes (in 16-bit lanes) moved into fp16's places: sign to bit 15, exponent
// and mantissa to bits 7-13, the number times 2^-8 (fp16's exponent bias is 8 above
// e4m3's; e4m3's subnormals land on fp16's, as gemv_fp8.cpp's weights); NaN (0x7F) to
// fp16's NaN.
inline __m128i as_fp16(__m128i bytes) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(bytes, 8), 1), _mm_set1_epi16(-0x4001));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));
}

// eight values at p, in fp32
inline __m256 widen8(const Fp8* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_mul_ps(_mm256_cvtph_ps(as_fp16(bytes)), _mm256_set1_ps(256.f));
}

// sixteen fp32 values (exactly bf16 values) as bf16, by their top halves
inline void store_bf16(c10::BFloat16* dst, __m256 lo, __m256 hi) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                             _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(packed, 0xD8));
}
#endif

#if defined(__AVX512BW__)
// as_fp16 for 32 values at p, in fp32: two vectors of 16
inline void widen32(const Fp8* p, __m512& lo, __m512& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(bytes, 8), 1), _mm512_set1_epi16(-0x4001));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(bytes, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7E00)));
  lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_set1_ps(256.f));
  hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), _mm512_set1_ps(256.f));
}

// 32 values from p into dst, as T (float or bf16)
template <typename T>
inline void widen32_to(const Fp8* p, T* dst) {
  __m512 lo, hi;
  widen32(p, lo, hi);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, lo);
    _mm512_storeu_ps(dst + 16, hi);
  } else {
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // exact: every value is a bf16 value
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
#endif
  }
}
#endif

// n values from src into dst (float or bf16 vectorised where the CPU allows; any other
// type through c10's conversions)
template <typename T>
inline void widen(const Fp8* src, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    for (; i + 32 <= n; i += 32) widen32_to(src + i, dst + i);
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= n; i += 16) store_bf16(dst + i, widen8(src + i), widen8(src + i + 8));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
}

}  // namespace vlmserve::fp8
