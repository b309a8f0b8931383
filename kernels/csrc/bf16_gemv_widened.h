// y = x W^T for bf16 x and a plain bf16 weight [N, K] on CPUs without bf16 arithmetic (no
// AVX512-BF16): AVX2 and FMA (AMD Zen 2/3, Intel client cores), or AVX-512F (Intel Xeons
// from Skylake to Ice Lake, and newer ones whose hypervisor hides AVX512-BF16). torch's
// bf16 matmul there runs at a tenth (AVX2: oneDNN refuses bf16) to a quarter (AVX-512F:
// oneDNN's emulated bf16) of the fp32 peak. Here the weight streams as bf16 and widens to
// fp32 in registers (a shift for the even inputs, a mask for the odd ones), multiplied by x
// widened once per call into the same even/odd order; fp32 sums. One weight row band of 4
// against a tile of rows of x; the weight rows of a block stay in L2 while every tile of x
// passes over them. AVX-512F takes twice the values an instruction and, with 32 registers,
// 4 rows of x a tile (x kept in registers across the band) where AVX2 takes 3.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"

namespace vlmserve::widened {

#if defined(__AVX512F__)
struct Vec {  // 16 fp32 lanes
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static I load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static F even(I raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
  static F odd(I raw) { return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xFFFF0000u)))); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
constexpr int kRowTile = 4;  // rows of x per tile: 4 x 4 accumulators, 8 x vectors, 2 weight vectors
#else
struct Vec {  // 8 fp32 lanes
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static I load_raw(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F even(I raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)); }
  static F odd(I raw) { return _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xFFFF0000u)))); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
constexpr int kRowTile = 3;  // rows of x per tile: 3 x 4 accumulators (16 registers)
#endif

constexpr int kStep = 2 * Vec::kLanes;      // bf16 weights per load
constexpr int kBand = 4;                    // weight rows per tile
constexpr int64_t kBlockBytes = 192 << 10;  // weight rows per block: about this many bytes (in L2)
// One row of x read in several streams (gemv_streams(): Intel cores): 8 weight rows a step,
// each asked for 1 KB ahead. On a Xeon without AVX512-BF16, a decode step's matrices at 3B
// widths (1.86 GB) streamed at 28.4 GB/s against 24.3 with 4 rows and the hardware
// prefetcher alone (a 1 GiB sum: 27.5); 8 rows alone 24.8, 4 rows asked ahead 27.2.
constexpr int kStreamRows = 8;
constexpr int64_t kAheadValues = 512;

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x (bf16, `count` values, a multiple of kStep) in fp32, each kStep as their even then odd values
inline void widen_even_odd(const uint16_t* x, int64_t count, float* out) {
  constexpr int half = Vec::kLanes;
  for (int64_t k = 0; k < count; k += kStep)
    for (int i = 0; i < half; ++i) {
      out[k + i] = widen(x[k + 2 * i]);
      out[k + half + i] = widen(x[k + 2 * i + 1]);
    }
}

// out[m * N + j] = x[m] . w[j] for MT rows of x (widened, stride K) and NB weight rows,
// each weight row asked for kAheadValues ahead when kAsk
template <int MT, int NB, bool kAsk = false>
inline void tile(const float* x, const uint16_t* w, int64_t K, int64_t N, float* out) {
  typename Vec::F acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = Vec::zero();
  for (int64_t k = 0; k < K; k += kStep) {
    for (int j = 0; j < NB; ++j) {
      if constexpr (kAsk) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kAheadValues), _MM_HINT_T0);
      const typename Vec::I raw = Vec::load_raw(w + j * K + k);
      const typename Vec::F even = Vec::even(raw), odd = Vec::odd(raw);
      for (int m = 0; m < MT; ++m) {
        acc[m][j] = Vec::fmadd(even, Vec::load(x + m * K + k), acc[m][j]);
        acc[m][j] = Vec::fmadd(odd, Vec::load(x + m * K + k + Vec::kLanes), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) out[m * N + j] = Vec::sum(acc[m][j]);
}

// fp32 sums out [M, N] of x [M, K] (bf16) and w [N, K] (bf16); K a multiple of kStep; one
// row of x in several streams if `streams` (the same sums either way)
inline void bf16_gemv(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, float* out,
                      bool streams) {
  std::vector<float> xf(M * K);
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) widen_even_odd(x + m * K, K, xf.data() + m * K);
  });
  const int64_t block = std::clamp<int64_t>(kBlockBytes / (2 * K) / kBand * kBand, kBand, 64);
  const int64_t tiles = (M + kRowTile - 1) / kRowTile;
  at::parallel_for(0, N, block, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {  // tiles of near-equal size (5 rows of 4: 3 + 2)
        const int rows = static_cast<int>((M - m0) / (tiles - t));
        const float* xt = xf.data() + m0 * K;
        int64_t n = b0;
        if (M == 1 && streams)
          for (; n + kStreamRows <= b1; n += kStreamRows) tile<1, kStreamRows, true>(xt, w + n * K, K, N, out + n);
        for (; n + kBand <= b1; n += kBand)
          with_constant<kRowTile>(rows, [&](auto mt) { tile<mt, kBand>(xt, w + n * K, K, N, out + m0 * N + n); });
        for (; n < b1; ++n)
          with_constant<kRowTile>(rows, [&](auto mt) { tile<mt, 1>(xt, w + n * K, K, N, out + m0 * N + n); });
        m0 += rows;
      }
    }
  });
}

}  // namespace vlmserve::widened
