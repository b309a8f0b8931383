// y = x W^T + b for a few rows of x (decode: one to a few tokens) and a bf16 weight: a
// matrix-vector product, bound by how fast the weight streams from memory. torch's bf16
// path (oneDNN) reads it at about half of what this CPU can; here each thread streams its
// own band of weight rows once, four at a time (eight for one row of x), each loaded 32 bf16
// at a time and multiplied with every row of x by AVX512-BF16 dot products (fp32
// accumulation); 4 to 16 rows of x (a batch decoding, where a layer has no packed copy) in
// tiles of up to 6. Without AVX512-BF16, bf16_gemv_widened.h's kernel (gemv.h).

#include "gemv.h"

#include "kernels.h"

namespace {

using vlmserve::gemv::gemv_streams;
using vlmserve::gemv::kBand;
using vlmserve::gemv::kGrainRows;
using vlmserve::gemv::with_bias_in_shape;

constexpr int64_t kMaxBf16Rows = 16;  // rows of x per call of the bf16 one (from 4: in tiles of up to 6)
constexpr int64_t kRowTileMax = 6;    // rows of x per tile: 6 x 4 fp32 accumulators, 4 weight vectors, x's
constexpr int64_t kPrefetchAhead = 512;  // weight elements each row is prefetched ahead by (1 row of x, 4 on)

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

}  // namespace

VLMSERVE_EXPORT(bf16_gemv);
