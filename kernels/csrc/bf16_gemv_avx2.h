// y = x W^T for bf16 x and a plain bf16 weight [N, K] on CPUs with AVX2 and FMA but no
// AVX512-BF16 (AMD Zen 2/3, Intel client cores): these have no bf16 arithmetic, and
// torch's bf16 matmul there runs at about a tenth of the fp32 peak (oneDNN refuses bf16
// below AVX-512). Here the weight streams as bf16 and widens to fp32 in registers (a shift
// for the even inputs, a mask for the odd ones), multiplied by x widened once per call
// into the same even/odd order; fp32 sums. One weight row band of 4 against up to 3 rows of
// x per tile; the weight rows of a block stay in L2 while every tile of x passes over them.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"

namespace vlmserve::avx2 {

constexpr int kBand = 4;                    // weight rows per tile
constexpr int kRowTile = 3;                 // rows of x per tile: 3 x 4 accumulators
constexpr int64_t kBlockBytes = 192 << 10;  // weight rows per block: about this many bytes (in L2)

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x (bf16, `count` values, a multiple of 16) in fp32, each 16 as their 8 even then 8 odd values
inline void widen_even_odd(const uint16_t* x, int64_t count, float* out) {
  for (int64_t k = 0; k < count; k += 16)
    for (int i = 0; i < 8; ++i) {
      out[k + i] = widen(x[k + 2 * i]);
      out[k + 8 + i] = widen(x[k + 2 * i + 1]);
    }
}

// out[m * N + j] = x[m] . w[j] for MT rows of x (widened, stride K) and NB weight rows
template <int MT, int NB>
inline void tile(const float* x, const uint16_t* w, int64_t K, int64_t N, float* out) {
  __m256 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; k += 16) {
    for (int j = 0; j < NB; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));
      for (int m = 0; m < MT; ++m) {
        acc[m][j] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + m * K + k), acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + m * K + k + 8), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) out[m * N + j] = sum_lanes(acc[m][j]);
}

// fp32 sums out [M, N] of x [M, K] (bf16) and w [N, K] (bf16); K a multiple of 16
inline void bf16_gemv(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, float* out) {
  std::vector<float> xf(M * K);
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) widen_even_odd(x + m * K, K, xf.data() + m * K);
  });
  const int64_t block = std::clamp<int64_t>(kBlockBytes / (2 * K) / kBand * kBand, kBand, 64);
  const int64_t tiles = (M + kRowTile - 1) / kRowTile;
  at::parallel_for(0, N, block, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {  // tiles of near-equal size (4 rows: 2 + 2)
        const int rows = static_cast<int>((M - m0) / (tiles - t));
        const float* xt = xf.data() + m0 * K;
        int64_t n = b0;
        for (; n + kBand <= b1; n += kBand)
          with_constant<kRowTile>(rows, [&](auto mt) { tile<mt, kBand>(xt, w + n * K, K, N, out + m0 * N + n); });
        for (; n < b1; ++n)
          with_constant<kRowTile>(rows, [&](auto mt) { tile<mt, 1>(xt, w + n * K, K, N, out + m0 * N + n); });
        m0 += rows;
      }
    }
  });
}

}  // namespace vlmserve::avx2
