// y = x W^T + b for a few rows of x and an int8 weight with one scale per row.
// int8_tiled_gemv (--quantization int8, W8A8) takes bf16 x: half the bytes of bf16 to stream,
// in tiles of 16 rows as int4's (gemv_int4.cpp), multiplied with x quantized to int8 per group
// of 128 by dpbusd; without AVX512-VNNI, int_gemv_avx2.h's kernel (gemv.h). int8_gemv takes
// the plain [N, K] weight and fp32 x, quantized to int16 per row (32 products an instruction),
// to stay as exact as fp32 parity needs.

#include "gemv.h"

#include "kernels.h"

namespace {

using vlmserve::gemv::kBand;
using vlmserve::gemv::kGrainRows;
using vlmserve::gemv::kGroup;
using vlmserve::gemv::kRowTile;
using vlmserve::gemv::kTile;
using vlmserve::gemv::with_bias_in_shape;
#if defined(VLMSERVE_INT_GEMV)
using vlmserve::gemv::quantize_rows;
using vlmserve::gemv::QuantizedRows;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
using vlmserve::gemv::bf16_to_float;
using vlmserve::gemv::bf16x16_to_fp32;
using vlmserve::gemv::by_row_tiles;
using vlmserve::gemv::by_streams_if_set;
using vlmserve::gemv::store16;
#endif

constexpr int64_t kMaxRows = 4;     // rows of x per call of the int8 GEMV (more: a matmul is the better tool)

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

constexpr int64_t kFlush = 256;  // int32 sums of int16 x int8 products flushed to fp32 this often (no overflow)

// out[m][n] = scale_x[m] * scale_w[n] * sum_k xq[m][k] * w[n][k]: x quantized to int16 per row
// (error ~1e-5 of its largest value, far below bf16's own rounding), weights widened to int16,
// products summed by AVX512-VNNI dpwssd, 32 a instruction.
// B weight rows from row n, all of K, into out[m * N + n + j].
template <int M, int B>
inline void int8_gemv_rows(const int16_t* x, const float* x_scales, const int8_t* w, const float* scales, int64_t K,
                           int64_t N, int64_t n, float* out) {
  float sums[M][B] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
    const int64_t k1 = std::min(K, k0 + kFlush);
    __m512i acc[M][B];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < B; ++j) acc[m][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 32) {
      __m512i xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(x + m * K + k);
      for (int j = 0; j < B; ++j) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + (n + j) * K + k)));
        for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpwssd_epi32(acc[m][j], xv[m], wv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < B; ++j) sums[m][j] += static_cast<float>(_mm512_reduce_add_epi32(acc[m][j]));
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < B; ++j) out[m * N + n + j] = sums[m][j] * x_scales[m] * scales[n + j];
}

template <int M>
void int8_gemv_band(const int16_t* x, const float* x_scales, const int8_t* w, const float* scales, int64_t K,
                    int64_t N, int64_t n0, int64_t n1, float* out) {
  int64_t n = n0;
  for (; n + kBand <= n1; n += kBand) int8_gemv_rows<M, kBand>(x, x_scales, w, scales, K, N, n, out);
  for (; n < n1; ++n) int8_gemv_rows<M, 1>(x, x_scales, w, scales, K, N, n, out);
}
#endif

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && K % 32 == 0 && x.size(-1) == K &&
              x.numel() / K <= kMaxRows && scales.numel() == N,
              "int8_gemv: x of at most 4 rows, a contiguous int8 weight [N, K] with K a multiple of 32, N scales");
  const int64_t M = x.numel() / K;
  // fp32 x: quantized to int16 per row, so that its products stay as exact as fp32 parity needs
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat);
  const at::Tensor x_scales = (xf.abs().amax(1) / 32767.0).clamp_min(1e-30);
  const at::Tensor xq = (xf / x_scales.unsqueeze(1)).round().to(at::kShort).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const int16_t* xp = xq.data_ptr<int16_t>();
  const float* xs = x_scales.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* op = acc.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: int8_gemv_band<1>(xp, xs, wp, sp, K, N, n0, n1, op); break;
      case 2: int8_gemv_band<2>(xp, xs, wp, sp, K, N, n0, n1, op); break;
      case 3: int8_gemv_band<3>(xp, xs, wp, sp, K, N, n0, n1, op); break;
      default: int8_gemv_band<4>(xp, xs, wp, sp, K, N, n0, n1, op); break;
    }
  });
#else
  TORCH_CHECK(false, "int8_gemv: built without AVX512-BF16 and AVX512-VNNI");
#endif
  return with_bias_in_shape(acc, x, bias);
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr int64_t kInt8TileGroupBytes = kTile * kGroup;  // a tile's group: 32 vectors of 64 bytes
// tiles read in lockstep with gemv_streams() (gemv.h, by_streams): eight for one row of x (its
// groups twice as long as int4's, which takes four), two for 2-4 rows
constexpr int int8_streams(int rows) { return rows == 1 ? 8 : 2; }

// The int8 tiled layout, for bf16 x (--quantization int8, W8A8): as int4's, tiles of 16 weight
// rows, a tile's groups of 128 inputs one after another, each 32 vectors of 64 bytes; vector
// v holds in lane r row r's inputs 4v..4v+3, each stored as w + 128 (unsigned, as dpbusd
// takes its first operand). One dpbusd multiplies 16 rows by 4 inputs of x (int8 per group,
// broadcast): one instruction per 64 weight bytes, where rows read one at a time need a
// horizontal sum per row and a second dot product for the sign. The offset's share,
// 128 * sum_k xq[m][k] per group, is x's alone: subtracted once per row of x at the end.
//
// out[m][16t..16t+15] = scale[n] * (sum over groups g of x_scale[m][g] * sum_k (w[n][k] + 128) *
// xq[m][k] - 128 * sum_g x_sum[m][g]).
template <int M, int S>
inline void int8_tile_rows(const int8_t* xq, const float* xs, const float* x_offset, const uint8_t* w,
                           const uint16_t* scales, int64_t K, int64_t N, int64_t r, int64_t t, int64_t stride,
                           float* out) {
  // independent dot products a row: one chain would wait on dpbusd's latency (S streams give S)
  constexpr int kChains = S >= 4 ? 1 : 4 / S;
  // one stream: 4 groups ahead; S streams: each 1 group ahead (the hardware prefetcher does the rest)
  constexpr int64_t kAhead = (S == 1 ? 4 : 1) * kInt8TileGroupBytes;
  const int64_t G = K / kGroup;
  __m512 acc[S][M];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[S][M][kChains];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < kChains; ++c) dot[s][m][c] = _mm512_setzero_si512();
    // kept a loop: fully unrolled, the compiler hoists a group's 32 prefetches into one
    // burst ahead of its loads, which then wait behind them (the GEMV 4-11% slower)
#pragma GCC unroll 1
    for (int v = 0; v < 32; v += kChains)
      for (int c = 0; c < kChains; ++c)
        for (int s = 0; s < S; ++s) {
          const uint8_t* wg = w + ((t + s * stride) * G + g) * kInt8TileGroupBytes;
          const __m512i packed = _mm512_loadu_si512(wg + (v + c) * 64);
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + (v + c) * 64), _MM_HINT_T0);
          for (int m = 0; m < M; ++m) {
            const int32_t* xm = reinterpret_cast<const int32_t*>(xq + (r + m) * K + g * kGroup);
            dot[s][m][c] = _mm512_dpbusd_epi32(dot[s][m][c], packed, _mm512_set1_epi32(xm[v + c]));
          }
        }
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m) {
        __m512i sum = dot[s][m][0];
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot[s][m][c]);
        acc[s][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs[(r + m) * G + g]), acc[s][m]);
      }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t tile = t + s * stride;
    const __m512 scale = bf16x16_to_fp32(scales + tile * kTile);
    for (int m = 0; m < M; ++m)
      _mm512_storeu_ps(out + (r + m) * N + tile * kTile,
                       _mm512_mul_ps(_mm512_sub_ps(acc[s][m], _mm512_set1_ps(x_offset[r + m])), scale));
  }
}
#endif

bool int8_tiled_args_ok(const at::Tensor& weight, const at::Tensor& scales) {
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.scalar_type() == at::kByte && weight.is_contiguous() && K % 128 == 0 && N % 16 == 0 &&
         scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == N;
}

constexpr const char* kInt8Layout =
    "a contiguous uint8 weight [N, K] in the int8 tiled layout with N a multiple of 16 and K of 128, N bf16 scales";

at::Tensor int8_tiled_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(int8_tiled_args_ok(weight, scales) && x.size(-1) == K, "int8_tiled_gemv: ", kInt8Layout);
  const int64_t M = x.numel() / K;
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const QuantizedRows xq = quantize_rows(x, M, K);
  const int8_t* xp = xq.values.data_ptr<int8_t>();
  const float* xs = xq.scales.data_ptr<float>();
  const float* xsum = xq.sums.data_ptr<float>();
  std::vector<float> x_offset(M, 0.f);  // the stored weights' offset times x, per row
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / kGroup; ++g) x_offset[m] += 128.f * xsum[m * (K / kGroup) + g];
  const float* xo = x_offset.data();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  at::parallel_for(0, N / kTile, kGrainRows / kTile, [&](int64_t t0, int64_t t1) {
    if (M <= kRowTile) {
      vlmserve::with_constant<kRowTile>(static_cast<int>(M), [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        by_streams_if_set<int8_streams(R)>(t0, t1, [&](auto streams, int64_t t, int64_t stride) {
          int8_tile_rows<R, decltype(streams)::value>(xp, xs, xo, wp, sp, K, N, 0, t, stride, op);
        });
      });
      return;
    }
    for (int64_t t = t0; t < t1; ++t)
      by_row_tiles(M, [&](auto rows, int64_t r) { int8_tile_rows<rows, 1>(xp, xs, xo, wp, sp, K, N, r, t, 0, op); });
  });
#elif defined(VLMSERVE_AVX2_GEMV)
  const QuantizedRows xq = quantize_rows(x, M, K);
  vlmserve::avx2::int8_tiled_gemv(xq.values.data_ptr<int8_t>(), xq.scales.data_ptr<float>(), weight.data_ptr<uint8_t>(),
                                  reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), M, K, N,
                                  acc.data_ptr<float>());
#else
  TORCH_CHECK(false, "int8_tiled_gemv: built without AVX512-VNNI or AVX2");
#endif
  return with_bias_in_shape(acc, x, bias);
}

// The int8 tiled weight dequantized into out ([N, K], bf16 or fp32): for the matmul of a
// prompt chunk. Row r of a tile's group is lane r of its 32 vectors, gathered.
void int8_tiled_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor& out) {
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(int8_tiled_args_ok(weight, scales) && out.is_contiguous() && out.sizes() == weight.sizes() &&
              (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "int8_tiled_dequantize: ", kInt8Layout, ", a contiguous bf16 or fp32 out [N, K]");
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const int64_t G = K / kGroup;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(kTile));  // dword v * 16 of each vector
  at::parallel_for(0, N / kTile, kGrainRows / kTile, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wg = wp + (t * G + g) * kInt8TileGroupBytes;
        for (int64_t r = 0; r < kTile; ++r) {
          const int64_t n = t * kTile + r;
          const __m512 scale = _mm512_set1_ps(bf16_to_float(sp[n]));
          const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(r));
          for (int64_t half = 0; half < 2; ++half) {  // vectors 0-15 (inputs 0..63), then 16-31
            alignas(64) uint8_t values[64];
            _mm512_store_si512(values, _mm512_i32gather_epi32(index, wg + half * 16 * 64, 4));
            for (int64_t i = 0; i < 64; i += 16) {
              const __m512i q = _mm512_sub_epi32(
                  _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(values + i))), _mm512_set1_epi32(128));
              const __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);
              store16(op, bf16, n * K + g * kGroup + half * 64 + i, value);
            }
          }
        }
      }
  });
#elif defined(VLMSERVE_AVX2_GEMV)
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  if (out.scalar_type() == at::kBFloat16)
    vlmserve::avx2::int8_tiled_dequantize(weight.data_ptr<uint8_t>(), sp, N, K, out.data_ptr<at::BFloat16>());
  else
    vlmserve::avx2::int8_tiled_dequantize(weight.data_ptr<uint8_t>(), sp, N, K, out.data_ptr<float>());
#else
  TORCH_CHECK(false, "int8_tiled_dequantize: built without AVX512-VNNI or AVX2");
#endif
}

}  // namespace

VLMSERVE_EXPORT(int8_gemv);
VLMSERVE_EXPORT(int8_tiled_gemv);
VLMSERVE_EXPORT(int8_tiled_dequantize);
