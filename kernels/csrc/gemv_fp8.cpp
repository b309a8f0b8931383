// y = x W^T + b for a few rows of x and an FP8 (e4m3) checkpoint's weight with 128 x 128 block
// scales: one byte a value, converted to fp32 in registers (no FP8 math on these CPUs).

#include "gemv.h"

#include "kernels.h"

namespace {

using vlmserve::gemv::kBand;
using vlmserve::gemv::kGrainRows;
using vlmserve::gemv::with_bias_in_shape;

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

VLMSERVE_EXPORT(fp8_gemv);
VLMSERVE_EXPORT(fp8_dequantize);
