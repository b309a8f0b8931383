// y = x W^T + b for a few rows of x (decode: one to a few tokens) and a bf16 weight: a
// matrix-vector product, bound by how fast the weight streams from memory. torch's bf16
// path (oneDNN) reads it at about half of what this CPU can; here each thread streams its
// own band of weight rows once, four at a time (eight for one row of x), each loaded 32 bf16
// at a time and multiplied with every row of x by AVX512-BF16 dot products (fp32
// accumulation); 4 to 16 rows of x (a batch decoding, where a layer has no packed copy) in
// tiles of up to 6.
// int8_tiled_gemv does it for an int8 weight with one scale per row (--quantization int8,
// W8A8) and bf16 x: half the bytes to stream, in tiles of 16 rows as int4's, multiplied with
// x quantized to int8 per group of 128 by dpbusd. int8_gemv takes the plain [N, K] weight and
// fp32 x, quantized to int16 per row (32 products an instruction), to stay as exact as fp32
// parity needs.
// int4_gemv does it for a 4-bit weight with a scale and zero point per group of 128 inputs
// (--quantization int4, AWQ, GPTQ): a quarter of the bytes, in tiles of 16 weight rows (one
// a 32-bit lane), multiplied with x quantized to int8 per group by dpbusd (64 products an
// instruction, 16 rows at once), each group's sums scaled into fp32 accumulators.
// On CPUs without AVX512-BF16 (AVX2, or AVX-512F alone: bf16_gemv_widened.h; int_gemv_avx2.h)
// bf16_gemv and the int8/int4 tiled kernels take the same arguments and layouts.
// fp8_gemv does it for an FP8 (e4m3) checkpoint's weight with 128 x 128 block scales: one
// byte a value, converted to fp32 in registers (no FP8 math on these CPUs).

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
#include "round_row.h"
#include "kernels.h"

namespace {

constexpr int64_t kMaxRows = 4;     // rows of x per call of the int8 GEMV (more: a matmul is the better tool)
constexpr int64_t kMaxBf16Rows = 16;  // rows of x per call of the bf16 one (from 4: in tiles of up to 6)
constexpr int64_t kRowTileMax = 6;    // rows of x per tile: 6 x 4 fp32 accumulators, 4 weight vectors, x's
constexpr int64_t kPrefetchAhead = 512;  // weight elements each row is prefetched ahead by (1 row of x, 4 on)
constexpr int64_t kBand = 4;        // weight rows per inner step (independent accumulators)
constexpr int64_t kGrainRows = 64;  // weight rows per parallel task

// Whether one row of x reads a thread's weight in several memory streams (the bf16 GEMV 8
// weight rows a step, each prefetched; int4 4 and int8 8 tiles in lockstep; 2-4 rows 2 tiles)
// or in one stream with software prefetches ahead (4 weight rows; 1 tile). Which reads
// faster depends on the core's prefetchers, so the Python side sets it once by CPU family
// (kernels/cpu_extension.py). Measured on Qwen2.5-VL-3B's matrices streaming from memory, one
// row of x, 2 threads: on an AMX Xeon several streams read int4 21 -> 26 GB/s, int8 23 -> 31-33,
// bf16 23-27 -> 27-33; on an AMD EPYC (Zen 4) one stream reads faster: int4 35-40 against
// 27-28 GB/s, int8 39-41 against 28, bf16 about even (0.85-1.03x).
std::atomic<bool> several_streams{false};

void set_gemv_streams(bool several) { several_streams.store(several, std::memory_order_relaxed); }
bool gemv_streams() { return several_streams.load(std::memory_order_relaxed); }

template <typename out_t, typename bias_t>
void round_rows(const float* acc, const bias_t* bias, out_t* out, int64_t M, int64_t N) {
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) vlmserve::round_row(acc + m * N, bias, out + m * N, N);
  });
}

at::Tensor with_bias_in_shape(at::Tensor& acc, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = acc.size(1);
  const bool fp32_bias = bias.has_value() && bias->scalar_type() == at::kFloat;
  const at::Tensor b = !bias.has_value() ? at::Tensor() : (fp32_bias ? *bias : bias->to(x.scalar_type())).contiguous();
  if (x.scalar_type() == at::kFloat && !bias.has_value()) return acc.view(shape);
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemv_out", [&] {
    if (fp32_bias)
      round_rows(acc.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<scalar_t>(), acc.size(0), acc.size(1));
    else
      round_rows(acc.data_ptr<float>(), b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(),
                 acc.size(0), acc.size(1));
  });
  return out;
}

bool supported(const at::Tensor& x, const at::Tensor& weight) {
#if defined(__AVX512BF16__)
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.is_contiguous() && weight.size(1) % 32 == 0 && x.size(-1) == weight.size(1) &&
         x.numel() / x.size(-1) <= kMaxBf16Rows;
#elif defined(VLMSERVE_AVX2_GEMV)
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.is_contiguous() && weight.size(1) % 32 == 0 && x.size(-1) == weight.size(1);
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// out[m][n] for n in [n0, n1), M rows of x (bf16, K each), fp32 results.
// With kStreams, one row of x takes 8 weight rows a step, each asked for kPrefetchAhead ahead:
// more loads in flight than the hardware prefetcher alone keeps for 4 rows (gemv_streams()).
template <int M, bool kStreams = false>
void gemv_band(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  constexpr int NB = kStreams ? 2 * kBand : kBand;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    __m512 acc[M][NB];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* rows = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int j = 0; j < NB; ++j) {
        if (kStreams) _mm_prefetch(reinterpret_cast<const char*>(rows + j * K + k + kPrefetchAhead), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(rows + j * K + k);
        for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NB; ++j) out[m * N + n + j] = _mm512_reduce_add_ps(acc[m][j]);
  }
  for (; n < n1; ++n) {  // the band's last rows, one at a time
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + n * K + k);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), wv);
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

// out[m][j] for MT rows of x from x (stride K) and NB weight rows from w (stride K), all
// of K; out's rows N apart. For 4 to 16 rows of x: each band of weight rows streams from
// memory for the first tile of x's rows and is read again from L1/L2 for the others.
// More instructions a byte than one row's loop, so fewer bytes in flight: the weight is
// prefetched ahead (measured, 8-16 rows: 5-8% faster).
template <int MT, int NB>
inline void tile_by_band(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, float* out) {
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kPrefetchAhead), _MM_HINT_T0);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) out[m * N + j] = _mm512_reduce_add_ps(acc[m][j]);
}

template <int NB>
inline void tile_rows(int64_t rows, const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, float* out) {
  switch (rows) {
    case 1: return tile_by_band<1, NB>(x, w, K, N, out);
    case 2: return tile_by_band<2, NB>(x, w, K, N, out);
    case 3: return tile_by_band<3, NB>(x, w, K, N, out);
    case 4: return tile_by_band<4, NB>(x, w, K, N, out);
    case 5: return tile_by_band<5, NB>(x, w, K, N, out);
    default: return tile_by_band<kRowTileMax, NB>(x, w, K, N, out);
  }
}

// weight rows [n0, n1) for all M rows of x, in tiles of near-equal size (8 rows: 4 + 4)
void tiled_band(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
                float* out) {
  const int64_t tiles = (M + kRowTileMax - 1) / kRowTileMax;
  for (int64_t n = n0; n < n1;) {
    const bool band = n + kBand <= n1;
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = (M - m0) / (tiles - t);
      if (band)
        tile_rows<kBand>(rows, x + m0 * K, w + n * K, K, N, out + m0 * N + n);
      else
        tile_rows<1>(rows, x + m0 * K, w + n * K, K, N, out + m0 * N + n);
      m0 += rows;
    }
    n += band ? kBand : 1;
  }
}
#endif

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(x, weight), "bf16_gemv: bf16 x, a contiguous bf16 weight [N, K] with "
              "K a multiple of 32, on a CPU with AVX512-BF16 (16 rows at most), AVX-512F or AVX2");
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = x.numel() / K;
  const at::Tensor xc = x.contiguous();
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1:
        if (gemv_streams()) gemv_band<1, true>(xp, wp, K, N, n0, n1, op);
        else gemv_band<1>(xp, wp, K, N, n0, n1, op);
        break;
      case 2: gemv_band<2>(xp, wp, K, N, n0, n1, op); break;
      case 3: gemv_band<3>(xp, wp, K, N, n0, n1, op); break;
      default: tiled_band(xp, wp, M, K, N, n0, n1, op); break;
    }
  });
#elif defined(VLMSERVE_AVX2_GEMV)
  vlmserve::widened::bf16_gemv(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                               reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), M, K, N,
                               acc.data_ptr<float>(), gemv_streams());
#endif
  return with_bias_in_shape(acc, x, bias);
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr int64_t kGroup = 128;   // inputs per scale and zero point
constexpr int64_t kRowTile = 4;   // rows of x per pass over a band's weights (kept in L1 meanwhile)

// 16 bf16 at p to fp32
inline __m512 bf16x16_to_fp32(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 fp32 values into out[i..i+15], out bf16 (rounded to nearest even) or fp32
inline void store16(void* out, bool bf16, int64_t i, __m512 value) {
  if (bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), (__m256i)_mm512_cvtneps_pbh(value));
  else
    _mm512_storeu_ps(static_cast<float*>(out) + i, value);
}
inline __m512 load16(const at::BFloat16* p) { return bf16x16_to_fp32(reinterpret_cast<const uint16_t*>(p)); }

// x [M, K] to int8 per group of 128 (scale = max |x| / 127, so no value is -128: the
// int8 kernel may negate any), each group's scale, and the sum of its quantized values
// times that scale. bf16 x is read as it is (its conversion to fp32 is exact), so a
// decode step's layers make no fp32 copy of their input.
template <typename T>
void quantize_groups(const T* src, int64_t groups, int8_t* values, float* scales, float* sums) {
  for (int64_t i = 0; i < groups; ++i) {
    const T* group = src + i * kGroup;
    __m512 top = _mm512_setzero_ps();
    for (int64_t k = 0; k < kGroup; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(group + k)));
    const float scale = std::max(_mm512_reduce_max_ps(top) / 127.0f, 1e-30f);
    const __m512 inverse = _mm512_set1_ps(1.0f / scale);
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < kGroup; k += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(load16(group + k), inverse),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      total = _mm512_add_epi32(total, rounded);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(values + i * kGroup + k), _mm512_cvtsepi32_epi8(rounded));
    }
    scales[i] = scale;
    sums[i] = static_cast<float>(_mm512_reduce_add_epi32(total)) * scale;
  }
}

#endif

#if defined(VLMSERVE_INT_GEMV)
#if defined(VLMSERVE_AVX2_GEMV)
constexpr int64_t kGroup = vlmserve::avx2::kGroup;
using vlmserve::avx2::quantize_groups;
#endif

struct QuantizedRows {
  at::Tensor values, scales, sums;
};

QuantizedRows quantize_rows(const at::Tensor& x, int64_t M, int64_t K) {
  const at::Tensor rows = x.reshape({M, K});
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  const at::Tensor src = (bf16 ? rows : rows.to(at::kFloat)).contiguous();
  const int64_t G = K / kGroup;
  const auto fp32 = x.options().dtype(at::kFloat);
  QuantizedRows q{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, G}, fp32), at::empty({M, G}, fp32)};
  int8_t* values = q.values.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  float* sums = q.sums.data_ptr<float>();
  if (bf16)
    quantize_groups(src.data_ptr<at::BFloat16>(), M * G, values, scales, sums);
  else
    quantize_groups(src.data_ptr<float>(), M * G, values, scales, sums);
  return q;
}
#endif

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
constexpr int64_t kTile = 16;        // weight rows per tile: one a 32-bit lane

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;  // a tile's group: 16 vectors of 64 bytes

// With gemv_streams(), a thread reads its tiles in several streams: S tiles (each from a
// contiguous part of the thread's tiles) in lockstep, one group ahead prefetched in each. On
// an Intel core the hardware prefetcher then follows the streams as it does the bf16 GEMV's
// weight rows, where one stream with software prefetches alone holds the core to fewer loads
// in flight (the line-fill buffers). On the AMX Xeon: int4 best with four streams (eight:
// 22-23 GB/s against 26), int8 with eight (its groups are twice as long). Two streams for 2-4
// rows (registers: streams x rows x chains accumulators).
constexpr int int4_streams(int rows) { return rows == 1 ? 4 : 2; }
constexpr int int8_streams(int rows) { return rows == 1 ? 8 : 2; }

// the tiles a thread's band [t0, t1) is read in: f(S, t, stride) multiplies tiles t, t + stride,
// ..., t + (S - 1) * stride together; the band's last tiles (fewer than S a stream) one at a time
template <int S, typename F>
inline void by_streams(int64_t t0, int64_t t1, F&& f) {
  const int64_t per_stream = (t1 - t0) / S;
  for (int64_t i = 0; i < per_stream; ++i) f(std::integral_constant<int, S>{}, t0 + i, per_stream);
  for (int64_t t = t0 + S * per_stream; t < t1; ++t) f(std::integral_constant<int, 1>{}, t, int64_t{0});
}

// by_streams with S streams where gemv_streams() says so, else with one
template <int S, typename F>
inline void by_streams_if_set(int64_t t0, int64_t t1, F&& f) {
  if (gemv_streams()) by_streams<S>(t0, t1, f);
  else by_streams<1>(t0, t1, f);
}

// The tiled layout: weight rows in tiles of 16, a tile's groups of 128 inputs one after
// another, each 16 vectors of 64 bytes; vector v holds in lane r (4 bytes) row r's inputs
// 4v..4v+3 (low nibbles) and 64+4v..64+4v+3 (high nibbles). So one dpbusd multiplies 16
// rows by the same 4 inputs of x (broadcast), the sums stay one a lane (no horizontal
// reduction), and a tile's 16 scales and zero points are one load each ([N/16, G, 16]).
//
// out[m][16t..16t+15] for M rows of x from row r and S tiles t + s * stride: sum over groups
// g of scale[n][g] * x_scale[m][g] * sum_k q[n][k] * xq[m][k] + zero[n][g] * x_sum[m][g].
template <int M, int S>
inline void int4_tile_rows(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* w,
                           const uint16_t* scales, const uint16_t* zeros, int64_t K, int64_t N, int64_t r,
                           int64_t t, int64_t stride, float* out) {
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

// f(M, r) for every row of x, kRowTile rows at a time (M a compile-time row count): a
// tile's weights stay in L2 meanwhile, so they stream from memory once
template <typename F>
inline void by_row_tiles(int64_t rows, F&& f) {
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

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr int64_t kInt8TileGroupBytes = kTile * kGroup;  // a tile's group: 32 vectors of 64 bytes

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

#if defined(__AVX512BF16__)
// 32 fp8 e4m3 weights to fp32, in two vectors of 16. The bits moved into fp16's places
// (sign to bit 15, exponent and mantissa to bits 7-13) are the same number times 2^-8,
// subnormals included: fp16's exponent bias is 8 above e4m3's, and its wider exponent
// keeps every e4m3 value normal or subnormal alike. The 2^8 comes back with the scale.
constexpr float kFp8Unbias = 256.f;

inline void fp8x32_to_fp32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // the byte to the top, shifted back one place arithmetically: the sign stays at bit 15
  // (and is copied into bit 14, cleared), exponent and mantissa land at bits 7-13
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(b, 8), 1), _mm512_set1_epi16(-0x4001));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// out[m][n] for B weight rows from n and M rows of x (fp32) from row r: each group of 128
// converted weights scaled by its block's scale, then multiplied with every row of x.
template <int M, int B>
inline void fp8_gemv_rows(const float* x, const uint8_t* w, const float* scales, int64_t K, int64_t N, int64_t r,
                          int64_t n, float* out) {
  constexpr int64_t kGroup = 128;
  const int64_t G = K / kGroup;
  __m512 acc[M][B];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < B; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // a group's products summed apart and scaled once at its end (one row of x: registers
    // to spare), or each converted weight scaled (several: the weights' registers are shared)
    __m512 part[M == 1 ? B : 1];
    for (int j = 0; j < (M == 1 ? B : 1); ++j) part[j] = _mm512_setzero_ps();
    __m512 scale[B];
    for (int j = 0; j < B; ++j) scale[j] = _mm512_set1_ps(scales[(n + j) * G + g] * kFp8Unbias);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 32) {
      __m512 x_lo[M], x_hi[M];
      for (int m = 0; m < M; ++m) {
        x_lo[m] = _mm512_loadu_ps(x + (r + m) * K + k);
        x_hi[m] = _mm512_loadu_ps(x + (r + m) * K + k + 16);
      }
      for (int j = 0; j < B; ++j) {
        __m512 lo, hi;
        fp8x32_to_fp32(w + (n + j) * K + k, lo, hi);
        if constexpr (M == 1) {
          part[j] = _mm512_fmadd_ps(hi, x_hi[0], _mm512_fmadd_ps(lo, x_lo[0], part[j]));
        } else {
          lo = _mm512_mul_ps(lo, scale[j]);
          hi = _mm512_mul_ps(hi, scale[j]);
          for (int m = 0; m < M; ++m)
            acc[m][j] = _mm512_fmadd_ps(hi, x_hi[m], _mm512_fmadd_ps(lo, x_lo[m], acc[m][j]));
        }
      }
    }
    if constexpr (M == 1)
      for (int j = 0; j < B; ++j) acc[0][j] = _mm512_fmadd_ps(part[j], scale[j], acc[0][j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < B; ++j) out[(r + m) * N + n + j] = _mm512_reduce_add_ps(acc[m][j]);
}

template <int B>
void fp8_gemv_step(const float* x, const uint8_t* w, const float* scales, int64_t K, int64_t N, int64_t rows,
                   int64_t n, float* out) {
  constexpr int64_t kTile = 4;  // rows of x per pass over the band's weights (in L1 meanwhile)
  int64_t r = 0;
  for (; r + kTile <= rows; r += kTile) fp8_gemv_rows<kTile, B>(x, w, scales, K, N, r, n, out);
  switch (rows - r) {
    case 1: fp8_gemv_rows<1, B>(x, w, scales, K, N, r, n, out); break;
    case 2: fp8_gemv_rows<2, B>(x, w, scales, K, N, r, n, out); break;
    case 3: fp8_gemv_rows<3, B>(x, w, scales, K, N, r, n, out); break;
    default: break;
  }
}
#endif

bool fp8_args_ok(const at::Tensor& weight, const at::Tensor& scales) {
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.scalar_type() == at::kByte && weight.is_contiguous() && K % 128 == 0 &&
         scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / 128);
}

// y = x W^T + b for an fp8 e4m3 weight (its bytes as uint8 [N, K]) with an fp32 scale per
// row and group of 128 inputs (FP8 checkpoints' 128 x 128 blocks, spread over their rows):
// the weight streams at one byte a value and is converted in registers.
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(fp8_args_ok(weight, scales) && x.size(-1) == weight.size(1),
              "fp8_gemv: a contiguous uint8 weight [N, K] with K a multiple of 128, fp32 scales [N, K / 128]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t M = x.numel() / K;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = acc.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + kBand <= n1; n += kBand) fp8_gemv_step<kBand>(xp, wp, sp, K, N, M, n, op);
    for (; n < n1; ++n) fp8_gemv_step<1>(xp, wp, sp, K, N, M, n, op);
  });
#else
  TORCH_CHECK(false, "fp8_gemv: built without AVX-512");
#endif
  return with_bias_in_shape(acc, x, bias);
}

// The fp8 weight dequantized into out ([N, K], bf16 or fp32): for the matmul of a prompt
// chunk, where converting once per call is small next to the multiplications.
void fp8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor& out) {
  TORCH_CHECK(fp8_args_ok(weight, scales) && out.is_contiguous() && out.sizes() == weight.sizes() &&
              (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "fp8_dequantize: a contiguous uint8 weight [N, K] with K a multiple of 128, fp32 scales "
              "[N, K / 128], a contiguous bf16 or fp32 out [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), G = K / 128;
#if defined(__AVX512BF16__)
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; k += 32) {
        const __m512 scale = _mm512_set1_ps(sp[n * G + k / 128] * kFp8Unbias);
        __m512 lo, hi;
        fp8x32_to_fp32(wp + n * K + k, lo, hi);
        lo = _mm512_mul_ps(lo, scale);
        hi = _mm512_mul_ps(hi, scale);
        if (bf16) {
          _mm512_storeu_si512(static_cast<uint16_t*>(op) + n * K + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
          _mm512_storeu_ps(static_cast<float*>(op) + n * K + k, lo);
          _mm512_storeu_ps(static_cast<float*>(op) + n * K + k + 16, hi);
        }
      }
  });
#else
  TORCH_CHECK(false, "fp8_dequantize: built without AVX-512");
#endif
}

}  // namespace

VLMSERVE_EXPORT(bf16_gemv);
VLMSERVE_EXPORT(int8_gemv);
VLMSERVE_EXPORT(int8_tiled_gemv);
VLMSERVE_EXPORT(int8_tiled_dequantize);
VLMSERVE_EXPORT(int4_gemv);
VLMSERVE_EXPORT(fp8_gemv);
VLMSERVE_EXPORT(fp8_dequantize);
VLMSERVE_EXPORT(int4_dequantize);
VLMSERVE_EXPORT(set_gemv_streams);
VLMSERVE_EXPORT(gemv_streams);
