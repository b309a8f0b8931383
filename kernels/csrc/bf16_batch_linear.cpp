// bf16 linear layers from a copy of the weight in the dot product's pair layout: on CPUs
// with AVX512-BF16 and no AMX for every row count (one user's decode step to a prompt's
// chunk; the copy takes the plain weight's place); on AVX-512F or AVX2 CPUs without it (no
// bf16 arithmetic) the same, each pair widened to fp32 in registers (a shift and a mask)
// and multiplied with x widened once per call.
//
// For a batch of decoding requests (4 to 64 rows) a matmul should cost the larger of its
// FLOPs at the CPU's peak and its weight bytes at the memory's bandwidth. oneDNN's matmul on its packed
// copy costs about their sum (Qwen2.5-VL-3B's MLP, 16 rows: 2.65 ms where the compute
// alone takes 1.6 and the weight 1.5; with the weight in cache it runs at the peak): it
// does not read ahead. This kernel streams the weight once, asking for the next 64 KB
// while it multiplies the current, so reading and computing overlap.
//
// Weight layout [N / 64, K / 2, 64, 2]: 64 output columns at a time, the input channels
// in pairs, each pair of 64 columns one 256-byte run; a thread's share of the weight is
// one contiguous stream. Rows are taken kRowTile at a time with their 64 columns' sums in
// registers (24 accumulators), over chunks of kChunkPairs channel pairs (32 KB of weight,
// which stays in L1/L2 while each row tile reuses it; widened: 6 rows, 24 accumulators, x
// broadcast where it is used). Where a chunk has several row tiles, each asks
// for its share of the stream ahead, so the memory is read evenly while the tiles multiply:
// when only the first tile asked (for 128 KB chunks), the reads came in bursts the memory
// could not serve and sat idle between them (3B widths, 8 layers and the head, AMD EPYC
// Zen 4: 16 rows 1.13x, 32 rows 1.30x the first-tile scheme; same sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define VLMSERVE_PAIR_KERNEL
#endif

#include "dispatch.h"
#include "round_row.h"
#include "kernels.h"

namespace {

constexpr int64_t kCols = 64;          // output columns per weight block (4 vectors of 16)
constexpr int64_t kChunkPairs = 128;   // channel pairs per chunk: 128 x 256 B = 32 KB
constexpr int64_t kRowBlock = 128;     // rows per pass over the weight (a prompt's rows, 128 at a time)
constexpr int64_t kAheadBytes = 128 << 10;  // how far ahead the stream is asked for

// the lines [ahead, until) of the stream asked for into L2
inline void ask_ahead(const char*& ahead, const char* until) {
  for (; ahead < until; ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
}

#if defined(__AVX512BF16__)
using XValue = uint32_t;            // x as its bf16 pairs, one value a pair
constexpr int64_t kXPerPair = 1;
constexpr int kRowTile = 6;         // rows per register tile (6 x 4 accumulators)
// Up to kRowTile rows (one tile) the weight streams once, in order, and the hardware
// prefetcher alone reads it fastest: asking ahead as well made 1-6 rows 1.05-1.1x slower
// when the memory was slow and up to 1.4x when it was fast (AMD EPYC Zen 4, 3B and Qwen3.5
// matrices, 2 threads; 1-4 rows then read 54-64 GB/s, over a 1 GiB sum's 46). From 7 rows
// each chunk is multiplied by two tiles or more, and asking ahead is 1.05-1.45x faster.
constexpr bool kOneTileAsksAhead = false;

// acc[r][c] (+)= sum over pairs p of x[r][2p:2p+2] . w[p][16c:16c+16][2] for R rows.
template <int R>
inline void row_tile(const uint32_t* x_pairs, int64_t x_stride, const uint16_t* w, int64_t pairs, float* c_rows,
                     bool first, const char* ahead, const char* ahead_stop, const char* stream_end) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c_rows + r * kCols + 16 * c);
  // the lines [ahead, ahead_stop) of the stream asked for into L2, spread evenly over the pairs
  ahead_stop = std::min(ahead_stop, stream_end);
  // (a multiply a pair, not a division: one row's loop has little else to hide it behind)
  const int64_t per_pair = ahead < ahead_stop ? (ahead_stop - ahead) / pairs : 0;
  const char* const ahead_begin = ahead;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kCols * 2;
    ask_ahead(ahead, p + 1 < pairs ? ahead_begin + per_pair * (p + 1) : ahead_stop);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r * x_stride + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xr);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xr);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(c_rows + r * kCols + 16 * c, acc[r][c]);
}

#elif defined(__AVX512F__)
using XValue = float;               // x widened to fp32, two values a pair
constexpr int64_t kXPerPair = 2;
// rows per register tile (6 x 4 accumulators). The shift and the mask that widen a vector
// of pairs run on the FMAs' two ports: a vector widened once for 6 rows' 12 FMAs leaves
// them 86% of those ports, for 4 rows' 8 FMAs 80% (an Ice Lake Xeon, one thread, a chunk
// in L1: 4 rows 126-133 GFLOP/s, 6 rows 136-143, FMAs alone 162-166).
constexpr int kRowTile = 6;
constexpr bool kOneTileAsksAhead = true;  // not measured without on such a CPU

// x's value broadcast where its FMAs use it: the compiler otherwise loads all of a tile's
// broadcasts first, and with 24 accumulators they spill (12 rows: 0.4x the speed)
inline __m512 broadcast(const float* x) {
  __m512 v;
  asm volatile("vbroadcastss %1, %0" : "=v"(v) : "m"(*x));
  return v;
}

// as above, each pair of w widened: its first values by a shift, its second by a mask
template <int R>
inline void row_tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t pairs, float* c_rows,
                     bool first, const char* ahead, const char* ahead_stop, const char* stream_end) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c_rows + r * kCols + 16 * c);
  ahead_stop = std::min(ahead_stop, stream_end);
  const int64_t span = ahead < ahead_stop ? ahead_stop - ahead : 0;
  const char* const ahead_begin = ahead;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kCols * 2;
    ask_ahead(ahead, ahead_begin + span * (p + 1) / pairs);
    __m512 wide[4];
    for (int c = 0; c < 4; ++c) wide[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wp + 32 * c), 16));
    for (int r = 0; r < R; ++r) {
      const __m512 xr = broadcast(x + r * x_stride + 2 * p);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(wide[c], xr, acc[r][c]);
    }
    for (int c = 0; c < 4; ++c)
      wide[c] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(wp + 32 * c), high_half));
    for (int r = 0; r < R; ++r) {
      const __m512 xr = broadcast(x + r * x_stride + 2 * p + 1);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(wide[c], xr, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(c_rows + r * kCols + 16 * c, acc[r][c]);
}

#elif defined(__AVX2__) && defined(__FMA__)
using XValue = float;               // x widened to fp32, two values a pair
constexpr int64_t kXPerPair = 2;
constexpr int kRowTile = 6;         // rows per register tile (6 x 2 accumulators, 2 of w, 1 of x)
constexpr bool kOneTileAsksAhead = true;  // not measured without on such a CPU

// as above with 16 registers of 8 lanes: the 64 columns in groups of 8 x C (C vectors of
// 8 sums a row: all 64 for one row, 32 for two, 16 for more), each group over all the
// chunk's pairs; a pair's first values (a shift) multiplied by every row's x, then its
// second values (a mask), each vector of pairs read again for its mask rather than kept:
// 12 accumulators, 2 widened vectors, x and the mask fill the 16 registers (kept, the
// vectors of pairs spilled an accumulator to the stack every pair: 6 rows on an Ice Lake
// Xeon's 256-bit units, one thread, 62-65 against 75-84 GFLOP/s at 64-256 rows)
template <int R>
inline void row_tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t pairs, float* c_rows,
                     bool first, const char* ahead, const char* ahead_stop, const char* stream_end) {
  constexpr int C = R == 1 ? 8 : (R == 2 ? 4 : 2);
  constexpr int kGroups = kCols / (8 * C);
  ahead_stop = std::min(ahead_stop, stream_end);
  const int64_t span = ahead < ahead_stop ? ahead_stop - ahead : 0;
  const char* const ahead_begin = ahead;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int g = 0; g < kGroups; ++g) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c_rows + r * kCols + 8 * (C * g + c));
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* wp = w + p * kCols * 2 + 16 * C * g;
      ask_ahead(ahead, ahead_begin + span * (g * pairs + p + 1) / (kGroups * pairs));
      const auto pairs_of = [wp](int c) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * c)); };
      __m256 wide[C];
      for (int c = 0; c < C; ++c) wide[c] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs_of(c), 16));
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + 2 * p);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wide[c], xr, acc[r][c]);
      }
      for (int c = 0; c < C; ++c) wide[c] = _mm256_castsi256_ps(_mm256_and_si256(pairs_of(c), high_half));
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + 2 * p + 1);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wide[c], xr, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(c_rows + r * kCols + 8 * (C * g + c), acc[r][c]);
  }
}

#endif

// out [N / 64, K / 2, 64, 2] <- weight [N, K]. A block of 64 columns' pairs takes the same
// bytes as those 64 rows of the weight, so each block goes through a copy of its rows and
// `out` may be the weight's own memory: packed in place, no second copy of the weight.
void bf16_pair_pack(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "a contiguous 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % 2 == 0, "the output size must be a multiple of 64 and the input size even");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({n / kCols, k / 2, kCols, 2}),
              "out must be a contiguous bf16 [N / 64, K / 2, 64, 2]");
  const uint32_t* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());  // pairs of channels
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  const int64_t half = k / 2;
  at::parallel_for(0, n / kCols, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> rows(kCols * half);
    for (int64_t b = b0; b < b1; ++b) {
      std::memcpy(rows.data(), src + b * kCols * half, rows.size() * sizeof(uint32_t));
      uint32_t* to = dst + b * half * kCols;
      for (int64_t c = 0; c < kCols; ++c)
        for (int64_t p = 0; p < half; ++p) to[p * kCols + c] = rows[c * half + p];
    }
  });
}

at::Tensor bf16_batch_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
#if defined(VLMSERVE_PAIR_KERNEL)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16 x and a weight from bf16_pair_pack");
  const int64_t k = x.size(-1), n = packed.size(0) * kCols, half = k / 2;
  TORCH_CHECK(packed.size(1) == half && k % 2 == 0, "x's last size must be the weight's input size");
  const at::Tensor xc = x.reshape({-1, k}).to(kXPerPair == 1 ? at::kBFloat16 : at::kFloat).contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  // the bias read in its own dtype (fp32, or bf16 as the layer's): no converted copy per call
  const bool has_bias = bias.has_value() && bias->defined();
  const bool fp32_bias = has_bias && bias->scalar_type() == at::kFloat;
  const at::Tensor b = !has_bias ? at::Tensor() : (fp32_bias ? *bias : bias->to(at::kBFloat16)).contiguous();
  const float* bias_f = fp32_bias ? b.data_ptr<float>() : nullptr;
  const at::BFloat16* bias_h = has_bias && !fp32_bias ? b.data_ptr<at::BFloat16>() : nullptr;
  const XValue* xp = reinterpret_cast<const XValue*>(xc.data_ptr());
  const int64_t x_stride = half * kXPerPair;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = packed.size(0);
  const int64_t block_elems = half * kCols * 2;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> c_rows(kRowBlock * kCols);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b_begin = blocks * t / threads, b_end = blocks * (t + 1) / threads;
      const char* my_end = reinterpret_cast<const char*>(wp + b_end * block_elems);
      for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
        const int64_t block_rows = std::min(kRowBlock, rows - row0);
        // row tiles of near-equal size: 32 rows in tiles of 6 as 6, 6, 5, 5, 5, 5 rather than 6 x 5 and 2
        const int64_t tiles = (block_rows + kRowTile - 1) / kRowTile;
        const bool asks_ahead = tiles > 1 || kOneTileAsksAhead;
        for (int64_t b = b_begin; b < b_end; ++b) {
          const uint16_t* wb = wp + b * block_elems;
          for (int64_t p0 = 0; p0 < half; p0 += kChunkPairs) {
            const int64_t pairs = std::min(kChunkPairs, half - p0);
            const uint16_t* wc = wb + p0 * kCols * 2;
            // the chunk's size of the stream kAheadBytes on, a share to each row tile
            const char* ahead = reinterpret_cast<const char*>(wc) + kAheadBytes;
            const int64_t ahead_len = asks_ahead ? pairs * kCols * 2 * static_cast<int64_t>(sizeof(uint16_t)) : 0;
            for (int64_t i = 0; i < tiles; ++i) {
              const int64_t r0 = block_rows * i / tiles, r1 = block_rows * (i + 1) / tiles;
              vlmserve::with_constant<kRowTile>(static_cast<int>(r1 - r0), [&](auto r) {
                row_tile<decltype(r)::value>(xp + (row0 + r0) * x_stride + p0 * kXPerPair, x_stride, wc, pairs,
                                             &c_rows[r0 * kCols],
                                             p0 == 0, ahead + ahead_len * i / tiles, ahead + ahead_len * (i + 1) / tiles,
                                             my_end);
              });
            }
          }
          for (int64_t r = 0; r < block_rows; ++r) {
            at::BFloat16* dst = reinterpret_cast<at::BFloat16*>(op + (row0 + r) * n + b * kCols);
            if (bias_f != nullptr)
              vlmserve::round_row(&c_rows[r * kCols], bias_f + b * kCols, dst, kCols);
            else
              vlmserve::round_row(&c_rows[r * kCols], bias_h ? bias_h + b * kCols : nullptr, dst, kCols);
          }
        }
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
#else
  TORCH_CHECK(false, "bf16_batch_linear needs AVX-512 or AVX2");
#endif
}

}  // namespace

VLMSERVE_EXPORT(bf16_pair_pack);
VLMSERVE_EXPORT(bf16_batch_linear);
