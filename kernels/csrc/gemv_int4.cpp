// y = x W^T + b for a few rows of x and a 4-bit weight with a scale and zero point per group
// of 128 inputs (--quantization int4, AWQ, GPTQ): a quarter of bf16's bytes, in tiles of 16
// weight rows (one a 32-bit lane), multiplied with x quantized to int8 per group by dpbusd (64
// products an instruction, 16 rows at once), each group's sums scaled into fp32 accumulators.
// Without AVX512-VNNI, int_gemv_avx2.h's kernel (gemv.h).

#include "gemv.h"

#include "kernels.h"

namespace {

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

constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;  // a tile's group: 16 vectors of 64 bytes
// tiles read in lockstep with gemv_streams() (gemv.h, by_streams): four for one row of x
// (eight: 22-23 GB/s against 26 on the AMX Xeon), two for 2-4 rows
constexpr int int4_streams(int rows) { return rows == 1 ? 4 : 2; }

// The tiled layout: weight rows in tiles of 16, a tile's groups of 128 inputs one after
// another, each 16 vectors of 64 bytes; vector v holds in lane r (4 bytes) row r's inputs
// 4v..4v+3 (low nibbles) and 64+4v..64+4v+3 (high nibbles). So one dpbusd multiplies 16
// rows by the same 4 inputs of x (broadcast), the sums stay one a lane (no horizontal
// reduction), and a tile's 16 scales and zero points are one load each ([N/16, G, 16]).
//
// out[m][16t..16t+15] for M rows of x from row r and S tiles t + s * stride: sum over groups
// g of scale[n][g] * x_scale[m][g] * sum_k q[n][k] * xq[m][k] + zero[n][g] * x_sum[m][g].
// Compiled on its own, a call per tile: inlined into int4_gemv's dispatch beside the other
// copies, the ones for 4 rows of x ran 1.2x (one stream) to 1.45x (two streams) slower
// (an AMD EPYC, Zen 4, one thread).
template <int M, int S>
__attribute__((noinline)) void int4_tile_rows(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* w,
                                              const uint16_t* scales, const uint16_t* zeros, int64_t K, int64_t N,
                                              int64_t r, int64_t t, int64_t stride, float* out) {
  // vectors a step: one stream takes two (four independent chains of dot products a row:
  // one chain would wait on dpbusd's latency); S streams give S x 2 chains with one
  constexpr int U = S == 1 ? 2 : 1;
  // one stream: 8 groups ahead; S streams: each 1 group ahead (the hardware prefetcher does the rest)
  constexpr int64_t kAhead = (S == 1 ? 8 : 1) * kTileGroupBytes;
  const int64_t G = K / kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const uint8_t* tiles[S];
  for (int s = 0; s < S; ++s) tiles[s] = w + (t + s * stride) * G * kTileGroupBytes;
  __m512 acc[S][M];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[S][M][2 * U];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < 2 * U; ++c) dot[s][m][c] = _mm512_setzero_si512();
#pragma GCC unroll 1  // kept a loop: unrolled, a group's prefetches go out in one burst (as int8's)
    for (int v = 0; v < 16; v += U) {
      for (int u = 0; u < U; ++u) {
        for (int s = 0; s < S; ++s) {
          const uint8_t* wg = tiles[s] + g * kTileGroupBytes;
          const __m512i packed = _mm512_loadu_si512(wg + (v + u) * 64);
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + (v + u) * 64), _MM_HINT_T0);
          const __m512i low = _mm512_and_si512(packed, low_nibbles);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
          for (int m = 0; m < M; ++m) {
            const int32_t* xm = reinterpret_cast<const int32_t*>(xq + (r + m) * K + g * kGroup);
            dot[s][m][2 * u] = _mm512_dpbusd_epi32(dot[s][m][2 * u], low, _mm512_set1_epi32(xm[v + u]));
            dot[s][m][2 * u + 1] =
                _mm512_dpbusd_epi32(dot[s][m][2 * u + 1], high, _mm512_set1_epi32(xm[16 + v + u]));
          }
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const int64_t group_scales = ((t + s * stride) * G + g) * kTile;  // the tile's 16 for group g
      const __m512 scale = bf16x16_to_fp32(scales + group_scales);
      const __m512 zero = bf16x16_to_fp32(zeros + group_scales);
      for (int m = 0; m < M; ++m) {
        __m512i sum = dot[s][m][0];
        for (int c = 1; c < 2 * U; ++c) sum = _mm512_add_epi32(sum, dot[s][m][c]);
        acc[s][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(xs[(r + m) * G + g])),
                                    acc[s][m]);
        acc[s][m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[(r + m) * G + g]), acc[s][m]);
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + (r + m) * N + (t + s * stride) * kTile, acc[s][m]);
}
#endif

bool int4_args_ok(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros) {
  const int64_t N = weight.size(0), K = weight.size(1) * 2;
  return weight.scalar_type() == at::kByte && weight.is_contiguous() && K % 128 == 0 && N % 16 == 0 &&
         scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
         zeros.is_contiguous() && scales.numel() == N * (K / 128) && zeros.numel() == N * (K / 128);
}

constexpr const char* kInt4Layout =
    "a contiguous uint8 weight [N, K / 2] in the tiled layout with N a multiple of 16 and K of 128, bf16 "
    "scales and zeros [N / 16, K / 128, 16]";

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& zeros, const c10::optional<at::Tensor>& bias) {
  const int64_t N = weight.size(0), K = weight.size(1) * 2;
  TORCH_CHECK(int4_args_ok(weight, scales, zeros) && x.size(-1) == K, "int4_gemv: ", kInt4Layout);
  const int64_t M = x.numel() / K;
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  // x quantized to int8 per group of 128 (as llama.cpp's Q8 activations), and each group's sum
  // of the quantized values: the zero points then see the same x as the nibbles, so the
  // rounding error is that of w * x, not of (w - zero) * x
  const QuantizedRows xq = quantize_rows(x, M, K);
  const int8_t* xp = xq.values.data_ptr<int8_t>();
  const float* xs = xq.scales.data_ptr<float>();
  const float* xsum = xq.sums.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  at::parallel_for(0, N / kTile, kGrainRows / kTile, [&](int64_t t0, int64_t t1) {
    if (M <= kRowTile) {
      vlmserve::with_constant<kRowTile>(static_cast<int>(M), [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        by_streams_if_set<int4_streams(R)>(t0, t1, [&](auto streams, int64_t t, int64_t stride) {
          int4_tile_rows<R, decltype(streams)::value>(xp, xs, xsum, wp, sp, zp, K, N, 0, t, stride, op);
        });
      });
      return;
    }
    for (int64_t t = t0; t < t1; ++t)
      by_row_tiles(M, [&](auto rows, int64_t r) { int4_tile_rows<rows, 1>(xp, xs, xsum, wp, sp, zp, K, N, r, t, 0, op); });
  });
#elif defined(VLMSERVE_AVX2_GEMV)
  const QuantizedRows xq = quantize_rows(x, M, K);
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  vlmserve::avx2::int4_gemv(xq.values.data_ptr<int8_t>(), xq.scales.data_ptr<float>(), xq.sums.data_ptr<float>(),
                            weight.data_ptr<uint8_t>(), sp, zp, M, K, N, acc.data_ptr<float>());
#else
  TORCH_CHECK(false, "int4_gemv: built without AVX512-VNNI or AVX2");
#endif
  return with_bias_in_shape(acc, x, bias);
}

// The tiled int4 weight dequantized into out ([N, K], bf16 or fp32): for the matmul of a
// prompt chunk. Row r of a tile's group is lane r of its 16 vectors, gathered.
void int4_dequantize(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros, at::Tensor& out) {
  const int64_t N = weight.size(0), K = weight.size(1) * 2;
  TORCH_CHECK(int4_args_ok(weight, scales, zeros) && out.is_contiguous() && out.size(0) == N && out.size(1) == K &&
              (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "int4_dequantize: ", kInt4Layout, ", a contiguous bf16 or fp32 out [N, K]");
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const int64_t G = K / kGroup;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(kTile));  // dword v * 16 of each vector
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  at::parallel_for(0, N / kTile, kGrainRows / kTile, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wg = wp + (t * G + g) * kTileGroupBytes;
        for (int64_t r = 0; r < kTile; ++r) {
          const int64_t n = t * kTile + r;
          const float scale = bf16_to_float(sp[(t * G + g) * kTile + r]);
          const float zero = bf16_to_float(zp[(t * G + g) * kTile + r]);
          // row r's 64 bytes: inputs 0..63 in the low nibbles, 64..127 in the high ones
          const __m512i packed = _mm512_i32gather_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(r)), wg, 4);
          alignas(64) uint8_t values[kGroup];
          _mm512_store_si512(values, _mm512_and_si512(packed, low_nibbles));
          _mm512_store_si512(values + 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles));
          for (int64_t i = 0; i < kGroup; i += 16) {
            const __m128i part = _mm_load_si128(reinterpret_cast<const __m128i*>(values + i));
            const __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)),
                                                 _mm512_set1_ps(scale), _mm512_set1_ps(zero));
            store16(op, bf16, n * K + g * kGroup + i, value);
          }
        }
      }
  });
#elif defined(VLMSERVE_AVX2_GEMV)
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  if (out.scalar_type() == at::kBFloat16)
    vlmserve::avx2::int4_dequantize(weight.data_ptr<uint8_t>(), sp, zp, N, K, out.data_ptr<at::BFloat16>());
  else
    vlmserve::avx2::int4_dequantize(weight.data_ptr<uint8_t>(), sp, zp, N, K, out.data_ptr<float>());
#else
  TORCH_CHECK(false, "int4_dequantize: built without AVX512-VNNI or AVX2");
#endif
}

}  // namespace

VLMSERVE_EXPORT(int4_gemv);
VLMSERVE_EXPORT(int4_dequantize);
