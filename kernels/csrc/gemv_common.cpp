// The decode GEMVs' shared steps (gemv.h): the streams switch, x quantized per group for the
// int8 and int4 tiled kernels, and the fp32 sums rounded into the output with the bias.

#include "gemv.h"

#include "round_row.h"
#include "kernels.h"

namespace vlmserve::gemv {

std::atomic<bool> several_streams{false};

}  // namespace vlmserve::gemv

namespace {

using vlmserve::gemv::kGroup;

void set_gemv_streams(bool several) { vlmserve::gemv::several_streams.store(several, std::memory_order_relaxed); }
bool gemv_streams() { return vlmserve::gemv::gemv_streams(); }

template <typename out_t, typename bias_t>
void round_rows(const float* acc, const bias_t* bias, out_t* out, int64_t M, int64_t N) {
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) vlmserve::round_row(acc + m * N, bias, out + m * N, N);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return vlmserve::gemv::bf16x16_to_fp32(reinterpret_cast<const uint16_t*>(p));
}

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
#elif defined(VLMSERVE_AVX2_GEMV)
using vlmserve::avx2::quantize_groups;
#endif

}  // namespace

namespace vlmserve::gemv {

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

#if defined(VLMSERVE_INT_GEMV)
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

}  // namespace vlmserve::gemv

VLMSERVE_EXPORT(set_gemv_streams);
VLMSERVE_EXPORT(gemv_streams);
