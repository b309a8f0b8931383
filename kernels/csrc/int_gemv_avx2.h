// The int8 and int4 tiled-layout GEMVs (gemv_int8.cpp, gemv_int4.cpp) on CPUs with AVX2 but no AVX512-VNNI
// (AMD Zen 2/3, Intel client cores): the same layout, the same x quantized to int8 per
// group of 128, the same sums; products by maddubs (u8 x s8 pairs to int16) and madd
// (int16 pairs to int32), 32 bytes of weight an instruction, 8 weight rows a vector (a
// tile's 64-byte vector is two: rows 0-7, then 8-15).
// int4: nibbles 0..15 times x in [-127, 127] cannot saturate maddubs' int16 (2 x 15 x 127).
// int8 is stored as w + 128, which could (2 x 255 x 127): the sign goes back with one xor
// and moves onto x (|w| times x signed as w), so each pair stays within 2 x 128 x 127.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dispatch.h"

namespace vlmserve::avx2 {

constexpr int64_t kGroup = 128;                          // inputs per group (x's scale; int4's scale and zero)
constexpr int64_t kTile = 16;                            // weight rows per tile
constexpr int64_t kInt8TileGroupBytes = kTile * kGroup;  // 32 vectors of 64 bytes
constexpr int64_t kInt4TileGroupBytes = kTile * kGroup / 2;  // 16 vectors of 64 bytes
// weight bytes asked for ahead: 2 groups of an int8 tile, 8 of an int4 one (one row of x,
// 22016 x 2048, 2 threads, Zen 3: with both halves of each 64 bytes read in turn, int8 13-15 ->
// 16-20 GB/s and int4 13-14 -> 15-16 against a pass per half; without prefetch 10-20% slower)
constexpr int64_t kInt8PrefetchBytes = 4096, kInt4PrefetchBytes = 8192;
constexpr int kIntRowTile = 4;                           // rows of x per pass over a tile (in L1/L2 meanwhile)
constexpr int64_t kGrainTiles = 4;                       // tiles per parallel task

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 8 bf16 at p as fp32
inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// x's groups of 128 to int8 (scale = max |x| / 127, rounded to nearest even), each group's
// scale and the sum of its quantized values times the scale: as the AVX-512 kernels' own
template <typename T>
inline void quantize_groups(const T* src, int64_t groups, int8_t* values, float* scales, float* sums) {
  for (int64_t i = 0; i < groups; ++i) {
    const T* group = src + i * kGroup;
    float top = 0.f;
    for (int64_t k = 0; k < kGroup; ++k) top = std::max(top, std::fabs(static_cast<float>(group[k])));
    const float scale = std::max(top / 127.0f, 1e-30f), inverse = 1.0f / scale;
    int32_t total = 0;
    for (int64_t k = 0; k < kGroup; ++k) {
      const float q = std::clamp(std::nearbyint(static_cast<float>(group[k]) * inverse), -127.f, 127.f);
      values[i * kGroup + k] = static_cast<int8_t>(q);
      total += static_cast<int32_t>(q);
    }
    scales[i] = scale;
    sums[i] = static_cast<float>(total) * scale;
  }
}

// out[m][16t .. 16t + 15] for MT rows of x from row r: sum over groups g of x_scale[m][g] *
// sum_k w[n][k] * xq[m][k], times the row's scale
template <int MT>
inline void int8_tile(const int8_t* xq, const float* xs, const uint8_t* w, const uint16_t* scales, int64_t K,
                      int64_t N, int64_t r, int64_t t, float* out) {
  const int64_t G = K / kGroup;
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + (t * G + g) * kInt8TileGroupBytes;
    __m256i dot[MT][2];
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int v = 0; v < 32; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + kInt8PrefetchBytes + v * 64), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {  // both halves of each 64 bytes in turn
        const __m256i signed_w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64 + h * 32)), sign_bit);
        const __m256i magnitude = _mm256_abs_epi8(signed_w);
        for (int m = 0; m < MT; ++m) {
          const int32_t* xm = reinterpret_cast<const int32_t*>(xq + (r + m) * K + g * kGroup);
          const __m256i x_signed = _mm256_sign_epi8(_mm256_set1_epi32(xm[v]), signed_w);
          dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x_signed), ones));
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 2; ++h)
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), _mm256_set1_ps(xs[(r + m) * G + g]), acc[m][h]);
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = load8_bf16(scales + t * kTile + h * 8);
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + (r + m) * N + t * kTile + h * 8, _mm256_mul_ps(acc[m][h], scale));
  }
}

// out[m][16t .. 16t + 15]: sum over groups g of scale[n][g] * x_scale[m][g] * sum_k q[n][k] * xq[m][k]
// + zero[n][g] * x_sum[m][g]
template <int MT>
inline void int4_tile(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* w, const uint16_t* scales,
                      const uint16_t* zeros, int64_t K, int64_t N, int64_t r, int64_t t, float* out) {
  const int64_t G = K / kGroup;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + (t * G + g) * kInt4TileGroupBytes;
    __m256i dot[MT][2];
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int v = 0; v < 16; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + kInt4PrefetchBytes + v * 64), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {  // both halves of each 64 bytes in turn, as int8's
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64 + h * 32));
        const __m256i low = _mm256_and_si256(packed, low_nibbles);  // inputs 4v..4v+3 of 8 rows
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);  // 64 + 4v..
        for (int m = 0; m < MT; ++m) {
          const int32_t* xm = reinterpret_cast<const int32_t*>(xq + (r + m) * K + g * kGroup);
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(xm[v])),
                                                 _mm256_maddubs_epi16(high, _mm256_set1_epi32(xm[16 + v])));
          dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = load8_bf16(scales + (t * G + g) * kTile + h * 8);
      const __m256 zero = load8_bf16(zeros + (t * G + g) * kTile + h * 8);
      for (int m = 0; m < MT; ++m) {
        const __m256 x_scale = _mm256_set1_ps(xs[(r + m) * G + g]);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), _mm256_mul_ps(scale, x_scale), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(zero, _mm256_set1_ps(xsum[(r + m) * G + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (r + m) * N + t * kTile + h * 8, acc[m][h]);
}

// f(rows, r) over tiles of up to kIntRowTile rows of x, rows a compile-time count
template <typename F>
inline void by_row_tiles(int64_t M, F&& f) {
  for (int64_t r = 0; r < M; r += kIntRowTile)
    with_constant<kIntRowTile>(static_cast<int>(std::min<int64_t>(kIntRowTile, M - r)), [&](auto rows) { f(rows, r); });
}

// fp32 sums out [M, N] for x quantized per group (xq [M, K], xs [M, K / 128]) and the tiled int8 weight
inline void int8_tiled_gemv(const int8_t* xq, const float* xs, const uint8_t* w, const uint16_t* scales, int64_t M,
                            int64_t K, int64_t N, float* out) {
  at::parallel_for(0, N / kTile, kGrainTiles, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      by_row_tiles(M, [&](auto rows, int64_t r) { int8_tile<rows>(xq, xs, w, scales, K, N, r, t, out); });
  });
}

inline void int4_gemv(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* w, const uint16_t* scales,
                      const uint16_t* zeros, int64_t M, int64_t K, int64_t N, float* out) {
  at::parallel_for(0, N / kTile, kGrainTiles, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      by_row_tiles(M, [&](auto rows, int64_t r) { int4_tile<rows>(xq, xs, xsum, w, scales, zeros, K, N, r, t, out); });
  });
}

// The tiled weights dequantized into out [N, K] (fp32 or bf16, rounded to nearest even):
// a tile's group transposed to rows (lane r of each vector is row r's), then converted.
template <typename out_t>
inline void int8_tiled_dequantize(const uint8_t* w, const uint16_t* scales, int64_t N, int64_t K, out_t* out) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, N / kTile, kGrainTiles, [&](int64_t t0, int64_t t1) {
    uint8_t rows[kTile][kGroup];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wg = w + (t * G + g) * kInt8TileGroupBytes;
        for (int v = 0; v < 32; ++v)
          for (int r = 0; r < kTile; ++r) std::memcpy(&rows[r][4 * v], wg + v * 64 + r * 4, 4);
        for (int r = 0; r < kTile; ++r) {
          const float scale = bf16_to_float(scales[t * kTile + r]);
          out_t* o = out + (t * kTile + r) * K + g * kGroup;
          for (int k = 0; k < kGroup; ++k) o[k] = static_cast<out_t>(static_cast<float>(rows[r][k] - 128) * scale);
        }
      }
  });
}

template <typename out_t>
inline void int4_dequantize(const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, int64_t N, int64_t K,
                            out_t* out) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, N / kTile, kGrainTiles, [&](int64_t t0, int64_t t1) {
    uint8_t rows[kTile][kGroup / 2];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wg = w + (t * G + g) * kInt4TileGroupBytes;
        for (int v = 0; v < 16; ++v)
          for (int r = 0; r < kTile; ++r) std::memcpy(&rows[r][4 * v], wg + v * 64 + r * 4, 4);
        for (int r = 0; r < kTile; ++r) {
          const float scale = bf16_to_float(scales[(t * G + g) * kTile + r]);
          const float zero = bf16_to_float(zeros[(t * G + g) * kTile + r]);
          out_t* o = out + (t * kTile + r) * K + g * kGroup;
          for (int k = 0; k < kGroup / 2; ++k) {  // byte k: input k (low nibble), input 64 + k (high)
            o[k] = static_cast<out_t>(static_cast<float>(rows[r][k] & 15) * scale + zero);
            o[kGroup / 2 + k] = static_cast<out_t>(static_cast<float>(rows[r][k] >> 4) * scale + zero);
          }
        }
      }
  });
}

}  // namespace vlmserve::avx2
