// The decode GEMVs' shared parts: y = x W^T + b for a few rows of x (decode: one to a few
// tokens), a matrix-vector product bound by how fast the weight streams from memory. One file
// per weight format holds its kernels: gemv_bf16.cpp, gemv_int8.cpp, gemv_int4.cpp,
// gemv_fp8.cpp. Here: which instruction sets they are built for, the sizes they share, whether
// a thread reads its weight in several streams, x quantized per group for the integer kernels,
// the fp32 sums rounded into the output (gemv_common.cpp), and the int8 and int4 tiled layout's
// walk over its tiles.
// On CPUs without AVX512-BF16 (AVX2, or AVX-512F alone: bf16_gemv_widened.h; int_gemv_avx2.h)
// bf16_gemv and the int8/int4 tiled kernels take the same arguments and layouts.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include "bf16_gemv_widened.h"
#include "int_gemv_avx2.h"
#define VLMSERVE_AVX2_GEMV  // no AVX512-BF16: bf16 widened to fp32 (AVX2 or AVX-512F), int8/int4 on AVX2
#endif
#if (defined(__AVX512BF16__) && defined(__AVX512VNNI__)) || defined(VLMSERVE_AVX2_GEMV)
#define VLMSERVE_INT_GEMV  // the int8 and int4 tiled-layout kernels: AVX512-VNNI or AVX2
#endif

#include "dispatch.h"

namespace vlmserve::gemv {

constexpr int64_t kBand = 4;        // weight rows per inner step (independent accumulators)
constexpr int64_t kGrainRows = 64;  // weight rows per parallel task
#if defined(VLMSERVE_AVX2_GEMV)
constexpr int64_t kGroup = vlmserve::avx2::kGroup;
#else
constexpr int64_t kGroup = 128;  // inputs per scale (x's; int4's scale and zero point)
#endif
constexpr int64_t kTile = 16;     // the tiled layout's weight rows per tile: one a 32-bit lane
constexpr int64_t kRowTile = 4;   // rows of x per pass over a band's weights (kept in L1 meanwhile)

// Whether one row of x reads a thread's weight in several memory streams (the bf16 GEMV 8
// weight rows a step, each prefetched; int4 4 and int8 8 tiles in lockstep; 2-4 rows 2 tiles)
// or in one stream with software prefetches ahead (4 weight rows; 1 tile). Which reads
// faster depends on the core's prefetchers, so the Python side sets it once by CPU family
// (kernels/cpu_extension.py, through set_gemv_streams in gemv_common.cpp). Measured on
// Qwen2.5-VL-3B's matrices streaming from memory, one row of x, 2 threads: on an AMX Xeon
// several streams read int4 21 -> 26 GB/s, int8 23 -> 31-33, bf16 23-27 -> 27-33; on an AMD
// EPYC (Zen 4) one stream reads faster: int4 35-40 against 27-28 GB/s, int8 39-41 against 28,
// bf16 about even (0.85-1.03x).
extern std::atomic<bool> several_streams;
static inline bool gemv_streams() { return several_streams.load(std::memory_order_relaxed); }

// acc [M, N] (fp32 sums) plus the bias, in x's shape and dtype (acc itself for fp32 x, no bias)
at::Tensor with_bias_in_shape(at::Tensor& acc, const at::Tensor& x, const c10::optional<at::Tensor>& bias);

#if defined(VLMSERVE_INT_GEMV)
// x [M, K] quantized to int8 per group of 128 (scale = max |x| / 127), each group's scale, and
// the sum of its quantized values times that scale
struct QuantizedRows {
  at::Tensor values, scales, sums;
};

QuantizedRows quantize_rows(const at::Tensor& x, int64_t M, int64_t K);
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
// 16 bf16 at p to fp32
static inline __m512 bf16x16_to_fp32(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 fp32 values into out[i..i+15], out bf16 (rounded to nearest even) or fp32
static inline void store16(void* out, bool bf16, int64_t i, __m512 value) {
  if (bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), (__m256i)_mm512_cvtneps_pbh(value));
  else
    _mm512_storeu_ps(static_cast<float*>(out) + i, value);
}

static inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// With gemv_streams(), a thread reads its tiles in several streams: S tiles (each from a
// contiguous part of the thread's tiles) in lockstep, one group ahead prefetched in each. On
// an Intel core the hardware prefetcher then follows the streams as it does the bf16 GEMV's
// weight rows, where one stream with software prefetches alone holds the core to fewer loads
// in flight (the line-fill buffers). On the AMX Xeon: int4 best with four streams (eight:
// 22-23 GB/s against 26), int8 with eight (its groups are twice as long). Two streams for 2-4
// rows (registers: streams x rows x chains accumulators).
//
// the tiles a thread's band [t0, t1) is read in: f(S, t, stride) multiplies tiles t, t + stride,
// ..., t + (S - 1) * stride together; the band's last tiles (fewer than S a stream) one at a time
template <int S, typename F>
static inline void by_streams(int64_t t0, int64_t t1, F&& f) {
  const int64_t per_stream = (t1 - t0) / S;
  for (int64_t i = 0; i < per_stream; ++i) f(std::integral_constant<int, S>{}, t0 + i, per_stream);
  for (int64_t t = t0 + S * per_stream; t < t1; ++t) f(std::integral_constant<int, 1>{}, t, int64_t{0});
}

// by_streams with S streams where gemv_streams() says so, else with one
template <int S, typename F>
static inline void by_streams_if_set(int64_t t0, int64_t t1, F&& f) {
  if (gemv_streams()) by_streams<S>(t0, t1, f);
  else by_streams<1>(t0, t1, f);
}

// f(M, r) for every row of x, kRowTile rows at a time (M a compile-time row count): a
// tile's weights stay in L2 meanwhile, so they stream from memory once
template <typename F>
static inline void by_row_tiles(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + kRowTile <= rows; r += kRowTile) f(std::integral_constant<int, kRowTile>{}, r);
  switch (rows - r) {
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    default: break;
  }
}
#endif

}  // namespace vlmserve::gemv
