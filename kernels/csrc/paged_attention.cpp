// Paged attention on the CPU, reading the KV cache where it lies.
//
// One call covers a whole mixed batch: decodes (one query token), prefills, and chunks of
// prefills over a cached prefix, with sliding windows and grouped-query attention. Keys
// and values stay in the cache's dtype (bf16, fp16 or fp32) and are converted as they are
// read; scores, softmax and the output accumulate in fp32 (online softmax), so nothing
// the size of a sequence is ever gathered or upcast.
//
// Layouts: q, out [tokens, q_heads, D]; key cache [blocks, kv_heads, D / 2, block_size, 2]
// (each block's keys transposed, so that a query's scores against a block are vector
// multiply-adds over the block's tokens, with pairs of channels side by side); value
// cache [blocks, kv_heads, block_size / 2, D, 2] (pairs of tokens side by side). The pairs
// are what AVX512-BF16's dot-product instruction takes: on CPUs that have it, bf16 caches
// are multiplied as they are stored, two products per lane and instruction. A block of
// one head is contiguous in both caches; the next one is prefetched while this one is
// computed. block_tables [seqs, max_blocks] (int32);
// query_start [seqs + 1] (int32: where each sequence's queries start in q); seq_lens [seqs]
// (int32: tokens in the cache once this step's are written, i.e. the last query's position
// + 1). Query j of a sequence with q_len queries sits at position seq_len - q_len + j and
// sees the keys at positions [max(0, pos - window + 1), end], where end is pos, or with
// key_ends [tokens] (int32, optional) max(pos, key_ends[token]): the tokens of a picture
// that attend to each other both ways (Gemma 3) see up to the picture's last one, which
// this step computes too. The window bounds only from below, as Gemma's masks do.
//
// Work is split into (sequence, KV head, tile of query tokens) items, handed out to the
// threads one at a time from a shared counter (decodes are cheap, long prefills are not).
// Within an item, the query heads that share the KV head and the tile's tokens form the
// rows; rows are processed kRows at a time with their scores and outputs in registers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "paged_attention_avx2.h"
#endif

#include "vec_math.h"
#include "kernels.h"

namespace {

constexpr int kTileTokens = 16;  // query tokens per work item
constexpr int kRows = 4;         // rows computed together (register tile)
constexpr int kReadAheadRows = 12;
constexpr int64_t kPrefetchBlocks = 2;  // blocks of keys and values asked for ahead of the one in use
// the running maximum of a row before any key (exp_approx of anything below -87 is 0)
constexpr float kNoScore = -1e30f;

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;  // query tokens [q_begin, q_end) of the sequence
  int32_t q_end;
};

struct Scratch {
  std::vector<float> q, o, row_max, row_sum, scores;
  std::vector<uint32_t> q_pairs, p_pairs;  // bf16 pairs, for the AVX512-BF16 path
  std::vector<int32_t> lo, hi;  // per row: the visible key positions [lo, hi]
  void reserve(int64_t rows, int64_t head_dim, int64_t block_size) {
    // Every per-row buffer has kReadAheadRows rows more than the item uses: GCC's
    // unrolled loops were seen to load past the rows they work on (the queries', in
    // block_scores for head sizes not compiled in: segfaults at an arena's mapped end).
    // The extra rows keep such loads inside the allocation; nothing reads their values.
    const int64_t n = rows + kReadAheadRows;
    q.assign(n * head_dim, 0.f);
    q_pairs.assign(n * head_dim / 2, 0u);
    p_pairs.resize(2 * kRows * block_size / 2);  // two blocks' (the bf16 path)
    o.assign(n * head_dim, 0.f);
    row_max.assign(n, kNoScore);
    row_sum.assign(n, 0.f);
    scores.resize(n * block_size);  // the other paths' (the bf16 path keeps its scores in registers)
    lo.resize(n);
    hi.resize(n);
  }
};

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// The AVX512-BF16 path: bf16 caches, 16-token blocks, head sizes a multiple of 16.
template <typename scalar_t, int BS, int D>
constexpr bool kBf16Dot = kHaveBf16Dot && std::is_same_v<scalar_t, c10::BFloat16> && BS == 16 && D > 0 && D % 16 == 0;

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kHaveAvx2 = true;
#else
constexpr bool kHaveAvx2 = false;
#endif

// The AVX2 path (paged_attention_avx2.h): bf16 caches without AVX512-BF16, and fp32 caches;
// 16-token blocks, head sizes a multiple of 16.
template <typename scalar_t, int BS, int D>
constexpr bool kAvx2 = kHaveAvx2 && !kBf16Dot<scalar_t, BS, D> && BS == 16 && D > 0 && D % 16 == 0 &&
                       (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);

// scores[r][t] = q[r] . key[t] for kRows rows and one block, already scaled (the bf16
// path: two_block_scores). q: the rows' scaled queries in fp32. BS, D > 0: sizes known at
// compile time (the accumulators stay in registers).
template <int BS, int D, typename scalar_t>
inline void block_scores(const float* q, const scalar_t* keys, float* scores, int64_t bs_rt, int64_t d_rt) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2<scalar_t, BS, D>) {
    vlmserve::avx2_attention::block_scores<kRows, D>(q, keys, scores);
    return;
  }
#endif
  if constexpr (BS > 0) {
    float acc[kRows][BS] = {};
    for (int64_t dp = 0; dp < dim / 2; ++dp) {
      float k0[BS], k1[BS];
      for (int t = 0; t < BS; ++t) {
        k0[t] = static_cast<float>(keys[(dp * BS + t) * 2]);
        k1[t] = static_cast<float>(keys[(dp * BS + t) * 2 + 1]);
      }
      for (int r = 0; r < kRows; ++r) {
        const float q0 = q[r * dim + 2 * dp], q1 = q[r * dim + 2 * dp + 1];
        for (int t = 0; t < BS; ++t) acc[r][t] += q0 * k0[t] + q1 * k1[t];
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < BS; ++t) scores[r * BS + t] = acc[r][t];
  } else {
    for (int64_t i = 0; i < kRows * bs; ++i) scores[i] = 0.f;
    for (int64_t d = 0; d < dim; ++d)
      for (int r = 0; r < kRows; ++r) {
        const float qd = q[r * dim + d];
        const scalar_t* kd = keys + (d / 2) * 2 * bs + (d & 1);
        for (int64_t t = 0; t < bs; ++t) scores[r * bs + t] += qd * static_cast<float>(kd[2 * t]);
      }
  }
}

// out[r] = out[r] * correction[r] + sum_t p[r][t] * value[t], for kRows rows and one block
// (the bf16 path: two_block_values).
template <int BS, int D, typename scalar_t>
inline void block_values(const float* p, const float* correction, const scalar_t* values,
                         float* out, int64_t bs_rt, int64_t d_rt) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2<scalar_t, BS, D>) {
    vlmserve::avx2_attention::block_values<kRows, D>(p, correction, values, out);
    return;
  }
#endif
  if constexpr (D > 0) {
    float acc[kRows][D];
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < D; ++d) acc[r][d] = out[r * D + d] * correction[r];
    for (int64_t tp = 0; tp < bs / 2; ++tp) {
      float v0[D], v1[D];
      for (int d = 0; d < D; ++d) {
        v0[d] = static_cast<float>(values[(tp * D + d) * 2]);
        v1[d] = static_cast<float>(values[(tp * D + d) * 2 + 1]);
      }
      for (int r = 0; r < kRows; ++r) {
        const float p0 = p[r * bs + 2 * tp], p1 = p[r * bs + 2 * tp + 1];
        for (int d = 0; d < D; ++d) acc[r][d] += p0 * v0[d] + p1 * v1[d];
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < D; ++d) out[r * D + d] = acc[r][d];
  } else {
    for (int r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] *= correction[r];
    for (int64_t t = 0; t < bs; ++t) {
      const scalar_t* vt = values + (t / 2) * 2 * dim + (t & 1);
      for (int r = 0; r < kRows; ++r) {
        const float pt = p[r * bs + t];
        for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += pt * static_cast<float>(vt[2 * d]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// The bf16 path's helpers hold their operands in registers only when inlined: without
// the attribute GCC called them (its growth limits for this file), the arrays of scores
// went through memory and a prompt chunk's call took 1.6x as long (measured).
#define VLMSERVE_INLINE inline __attribute__((always_inline))

// e^x for 16 lanes: vec_math.h's exp_approx, in intrinsics
VLMSERVE_INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ), p, scale);
}
#endif

// Online softmax over one block for kRows rows: scores become p = exp(score - max) where
// the key is visible (0 elsewhere), and each row's running max and sum move on; the
// factor earlier outputs must be rescaled by goes to `correction` (the bf16 path:
// two_block_softmax). Returns whether any row sees a key of the block.
template <typename scalar_t, int BS, int D>
inline bool block_softmax(float* sc, const int32_t* lo, const int32_t* hi, int64_t key0, float* row_max,
                          float* row_sum, float* correction, int64_t bs_rt) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  bool any = false;
  for (int r = 0; r < kRows; ++r) {
    const int64_t t0 = std::max<int64_t>(lo[r] - key0, 0);
    const int64_t t1 = std::min<int64_t>(hi[r] - key0, bs - 1);
    float* row = sc + r * bs;
    float mx = row_max[r], sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kAvx2<scalar_t, BS, D>) {
      sum = vlmserve::avx2_attention::block_softmax_row(row, t0, t1, mx);
    } else
#endif
    {
      for (int64_t t = t0; t <= t1; ++t) mx = std::max(mx, row[t]);
      for (int64_t t = 0; t < bs; ++t) row[t] = (t >= t0 && t <= t1) ? vlmserve::exp_approx(std::min(row[t] - mx, 0.f)) : 0.f;
      for (int64_t t = 0; t < bs; ++t) sum += row[t];
    }
    correction[r] = vlmserve::exp_approx(row_max[r] - mx);  // 0 before the first visible key
    row_sum[r] = row_sum[r] * correction[r] + sum;
    row_max[r] = mx;
    any = any || t0 <= t1;
  }
  return any;
}

#if defined(__AVX512BF16__)
// The bf16 path's scores, for kRows rows against two blocks at once (Pair false: one,
// the last), left in registers for two_block_softmax, already scaled. The two
// blocks in one pass keep eight accumulators busy where one block's four waited on the dot
// product's latency, and each query pair is broadcast once for both; the scores no longer
// go through memory. Against one block at a time with stored scores (heads of 128, 16 / 2;
// AMD EPYC Zen 4, 2 threads): the scores alone of a 4,096-token chunk over 8,192 keys
// 1.35x faster; whole calls, the two builds taking turns: a 2,048-token chunk over 4,096
// keys 1.14x (0.315 against 0.277 TFLOP/s), a decode step of 32 sequences of 1,100 tokens
// 1.05-1.15x.
template <bool Pair, int BS, int D, typename scalar_t>
VLMSERVE_INLINE void two_block_scores(const uint32_t* q_pairs, float scale, const scalar_t* keys_a,
                                      const scalar_t* keys_b, __m512* sc_a, __m512* sc_b) {
  for (int r = 0; r < kRows; ++r) sc_a[r] = sc_b[r] = _mm512_setzero_ps();
  if constexpr (Pair) {
    for (int dp = 0; dp < D / 2; ++dp) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(keys_a + dp * 2 * BS);
      const __m512bh kb = (__m512bh)_mm512_loadu_si512(keys_b + dp * 2 * BS);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qr = (__m512bh)_mm512_set1_epi32(q_pairs[r * (D / 2) + dp]);
        sc_a[r] = _mm512_dpbf16_ps(sc_a[r], qr, ka);
        sc_b[r] = _mm512_dpbf16_ps(sc_b[r], qr, kb);
      }
    }
  } else {
    for (int dp = 0; dp < D / 2; ++dp) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(keys_a + dp * 2 * BS);
      for (int r = 0; r < kRows; ++r)
        sc_a[r] = _mm512_dpbf16_ps(sc_a[r], (__m512bh)_mm512_set1_epi32(q_pairs[r * (D / 2) + dp]), ka);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    sc_a[r] = _mm512_mul_ps(sc_a[r], _mm512_set1_ps(scale));
    sc_b[r] = _mm512_mul_ps(sc_b[r], _mm512_set1_ps(scale));
  }
}

// The bf16 path over two blocks at once (decodes and short chunks spend more on each
// block's softmax bookkeeping than on its products): block_softmax for kRows rows whose
// scores are sc_a (this block) and sc_b (the next, when Pair; ignored past the last), one
// maximum, one correction and one sum for both; p rounded to bf16 as p_a / p_b pairs.
template <bool Pair, int BS>
VLMSERVE_INLINE bool two_block_softmax(const __m512* sc_a, const __m512* sc_b, const int32_t* lo, const int32_t* hi,
                                       int64_t key0, float* row_max, float* row_sum, float* correction, uint32_t* p_a,
                                       uint32_t* p_b) {
  static_assert(BS == 16, "one vector a block");
  auto visible_mask = [](int64_t t0, int64_t t1) -> __mmask16 {
    t0 = std::max<int64_t>(t0, 0);
    t1 = std::min<int64_t>(t1, BS - 1);
    return t0 > t1 ? 0 : static_cast<__mmask16>(((1u << (t1 + 1)) - 1) & ~((1u << t0) - 1));
  };
  auto rounded_sum = [](__m256bh rounded) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)rounded), 16));
  };
  bool any = false;
  for (int r = 0; r < kRows; ++r) {
    const __mmask16 va = visible_mask(lo[r] - key0, hi[r] - key0);
    const __mmask16 vb = Pair ? visible_mask(lo[r] - key0 - BS, hi[r] - key0 - BS) : 0;
    const __m512 a = sc_a[r];
    const __m512 b = sc_b[r];
    float mx = row_max[r];
    if (va | vb) mx = std::max(mx, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), va, a),
                                                                        _mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), vb, b))));
    const __m512 m = _mm512_set1_ps(mx);
    const __m256bh ra = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(va, exp16(_mm512_sub_ps(a, m))));
    const __m256bh rb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(vb, exp16(_mm512_sub_ps(b, m))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_a + r * (BS / 2)), (__m256i)ra);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_b + r * (BS / 2)), (__m256i)rb);
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(rounded_sum(ra), rounded_sum(rb)));
    correction[r] = vlmserve::exp_approx(row_max[r] - mx);  // 0 before the first visible key
    row_sum[r] = row_sum[r] * correction[r] + sum;
    row_max[r] = mx;
    any = any || (va | vb);
  }
  return any;
}

// out[r] = out[r] * correction[r] + p_a[r] . values_a + p_b[r] . values_b (values_b
// nullptr past the last block): block_values over two blocks, out read and written once.
template <int BS, int D, typename scalar_t>
VLMSERVE_INLINE void two_block_values(const uint32_t* p_a, const uint32_t* p_b, const float* correction,
                                      const scalar_t* values_a, const scalar_t* values_b, float* out) {
  constexpr int kChunks = D % 64 == 0 ? 4 : D % 32 == 0 ? 2 : 1;  // up to 64 channels at a time
  for (int d0 = 0; d0 < D; d0 += 16 * kChunks) {
    __m512 acc[kRows][kChunks];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kChunks; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * D + d0 + 16 * c), _mm512_set1_ps(correction[r]));
    for (int half = 0; half < (values_b ? 2 : 1); ++half) {
      const scalar_t* values = half ? values_b : values_a;
      const uint32_t* p = half ? p_b : p_a;
      for (int tp = 0; tp < BS / 2; ++tp) {
        for (int c = 0; c < kChunks; ++c) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(values + (tp * D + d0 + 16 * c) * 2);
          for (int r = 0; r < kRows; ++r)
            acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(p[r * (BS / 2) + tp]), v);
        }
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + r * D + d0 + 16 * c, acc[r][c]);
  }
}
#endif

// Asks for the keys and values of one head's blocks [first, last] of a sequence (each a
// random place in memory) to be brought into cache.
template <typename scalar_t>
inline void ask_for_blocks(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_table, int64_t first,
                           int64_t last, int64_t kv_heads, int64_t kv_head, int64_t block_elems) {
  for (int64_t b = first; b <= last; ++b) {
    const int64_t start = (block_table[b] * kv_heads + kv_head) * block_elems;
    const char* keys = reinterpret_cast<const char*>(k_cache + start);
    const char* values = reinterpret_cast<const char*>(v_cache + start);
    for (int64_t off = 0; off < block_elems * int64_t(sizeof(scalar_t)); off += 64) {
      __builtin_prefetch(keys + off);
      __builtin_prefetch(values + off);
    }
  }
}

template <typename scalar_t, int BS, int D>
void attend_item(const WorkItem& w, const scalar_t* q, scalar_t* out, const scalar_t* k_cache,
                 const scalar_t* v_cache, const int32_t* block_table, int32_t q_start, int32_t seq_len,
                 int32_t q_len, const int32_t* key_ends, int64_t window, float scale, int64_t q_heads, int64_t kv_heads, int64_t d_rt,
                 int64_t bs_rt, Scratch& s) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
  const int64_t group = q_heads / kv_heads;
  const int64_t rows = (w.q_end - w.q_begin) * group;  // row r: token r / group, head kv_head * group + r % group
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;  // padding rows see no key
  const int64_t first_pos = seq_len - q_len;
  int64_t last_key = 0;
  s.reserve(padded, dim, bs);
  for (int64_t r = 0; r < padded; ++r) {
    if (r >= rows) {
      s.lo[r] = 1;
      s.hi[r] = 0;  // an empty range
      continue;
    }
    const int64_t token = q_start + w.q_begin + r / group;
    const int64_t head = w.kv_head * group + r % group;
    const scalar_t* src = q + (token * q_heads + head) * dim;
    if constexpr (kBf16Dot<scalar_t, BS, D>)  // the dot products take the bf16 pairs as they are
      std::memcpy(s.q_pairs.data() + r * dim / 2, src, dim * sizeof(scalar_t));
    else
      for (int64_t d = 0; d < dim; ++d) s.q[r * dim + d] = static_cast<float>(src[d]) * scale;
    const int64_t pos = first_pos + w.q_begin + r / group;
    // a key range may end past the query (a picture's tokens that see each other), never past the sequence
    const int64_t end = key_ends ? std::min<int64_t>(std::max<int64_t>(key_ends[token], pos), seq_len - 1) : pos;
    s.hi[r] = static_cast<int32_t>(end);
    s.lo[r] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
    last_key = std::max(last_key, end);
  }
  const int64_t last_pos = last_key;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + w.q_begin - window + 1) : 0;
  const int64_t block_elems = dim * bs;  // of one head, in either cache
  float correction[kRows];
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dot<scalar_t, BS, D>) {
    // two blocks a round; the next two are asked for while these are computed
    const int64_t last_block = last_pos / bs;
    for (int64_t b = lo / bs; b <= last_block; b += 2) {
      const bool pair = b + 1 <= last_block;
      const scalar_t* keys_a = k_cache + (block_table[b] * kv_heads + w.kv_head) * block_elems;
      const scalar_t* values_a = v_cache + (block_table[b] * kv_heads + w.kv_head) * block_elems;
      const scalar_t* keys_b = pair ? k_cache + (block_table[b + 1] * kv_heads + w.kv_head) * block_elems : nullptr;
      const scalar_t* values_b = pair ? v_cache + (block_table[b + 1] * kv_heads + w.kv_head) * block_elems : nullptr;
      ask_for_blocks(k_cache, v_cache, block_table, b + 2, std::min(b + 3, last_block), kv_heads, w.kv_head, block_elems);
      uint32_t* p_a = s.p_pairs.data();
      uint32_t* p_b = p_a + kRows * BS / 2;
      for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
        // the scores stay in registers (arrays of each branch's own: declared once for both,
        // GCC kept them in memory)
        if (pair) {
          __m512 sc_a[kRows], sc_b[kRows];
          two_block_scores<true, BS, D>(s.q_pairs.data() + r0 * dim / 2, scale, keys_a, keys_b, sc_a, sc_b);
          if (!two_block_softmax<true, BS>(sc_a, sc_b, s.lo.data() + r0, s.hi.data() + r0, b * bs,
                                           s.row_max.data() + r0, s.row_sum.data() + r0, correction, p_a, p_b))
            continue;
        } else {
          __m512 sc_a[kRows], sc_b[kRows];
          two_block_scores<false, BS, D>(s.q_pairs.data() + r0 * dim / 2, scale, keys_a, keys_b, sc_a, sc_b);
          if (!two_block_softmax<false, BS>(sc_a, sc_b, s.lo.data() + r0, s.hi.data() + r0, b * bs,
                                            s.row_max.data() + r0, s.row_sum.data() + r0, correction, p_a, p_b))
            continue;
        }
        two_block_values<BS, D>(p_a, p_b, correction, values_a, values_b, s.o.data() + r0 * dim);
      }
    }
  } else
#endif
  for (int64_t b = lo / bs; b <= last_pos / bs; ++b) {
    const int64_t block = block_table[b];
    const scalar_t* keys = k_cache + (block * kv_heads + w.kv_head) * block_elems;
    const scalar_t* values = v_cache + (block * kv_heads + w.kv_head) * block_elems;
    // the next two blocks of this head (each a random place in memory) are asked for at
    // every block, so each block twice, two ahead and one ahead: a decode step of 256
    // sequences ran 1.13x faster than with the next block alone (1.3x with their blocks
    // scattered), 32 sequences of ~1,100 tokens at heads of 128 1.25x; asking once, two
    // blocks ahead, gained nothing (AMD EPYC, 2 threads)
    ask_for_blocks(k_cache, v_cache, block_table, b + 1, std::min(b + kPrefetchBlocks, last_pos / bs), kv_heads,
                   w.kv_head, block_elems);
    const int64_t key0 = b * bs;
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      float* sc = s.scores.data() + r0 * bs;
      block_scores<BS, D>(s.q.data() + r0 * dim, keys, sc, bs, dim);
      const bool any = block_softmax<scalar_t, BS, D>(sc, s.lo.data() + r0, s.hi.data() + r0, key0,
                                                       s.row_max.data() + r0, s.row_sum.data() + r0, correction, bs);
      if (!any) continue;
      block_values<BS, D>(sc, correction, values, s.o.data() + r0 * dim, bs, dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + w.q_begin + r / group;
    const int64_t head = w.kv_head * group + r % group;
    scalar_t* dst = out + (token * q_heads + head) * dim;
    const float inv = 1.f / s.row_sum[r];
#if defined(__AVX512BF16__)
    if constexpr (kBf16Dot<scalar_t, BS, D>) {  // rounded to nearest even, as the scalar cast
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s.o.data() + r * D + d), _mm512_set1_ps(inv))));
      continue;
    }
#endif
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(s.o[r * dim + d] * inv);
  }
}

template <typename scalar_t, int BS, int D>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
         const int32_t* key_ends, int64_t window, double scale) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(3);  // keys [blocks, heads, D / 2, bs, 2]
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.size(1);
  std::vector<WorkItem> items;
  for (int32_t seq = 0; seq < num_seqs; ++seq) {
    const int32_t q_len = qs[seq + 1] - qs[seq];
    for (int32_t begin = 0; begin < q_len; begin += kTileTokens)
      for (int32_t h = 0; h < kv_heads; ++h) items.push_back({seq, h, begin, std::min(begin + kTileTokens, q_len)});
  }
  // the costliest first (the last tokens of long prefills see the most keys)
  auto cost = [&](const WorkItem& w) {
    return int64_t(w.q_end - w.q_begin) * (sl[w.seq] - (qs[w.seq + 1] - qs[w.seq]) + w.q_end);
  };
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const WorkItem& w = items[i];
      attend_item<scalar_t, BS, D>(w, qp, op, kp, vp, bt + w.seq * bt_stride, qs[w.seq], sl[w.seq],
                                   qs[w.seq + 1] - qs[w.seq], key_ends, window, static_cast<float>(scale), q_heads, kv_heads,
                                   dim, block_size, scratch);
    }
  });
}

template <typename scalar_t, int BS>
void dispatch_head_size(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                        const int32_t* key_ends, int64_t window, double scale) {
  switch (q.size(2)) {
    case 64: return run<scalar_t, BS, 64>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
    case 128:
      return run<scalar_t, BS, 128>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
    case 256:  // Qwen3.5, Gemma 3
      return run<scalar_t, BS, 256>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
    default: return run<scalar_t, BS, 0>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
  }
}

template <typename scalar_t>
void dispatch(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
              const int32_t* key_ends, int64_t window, double scale) {
  switch (k_cache.size(3)) {  // the block size
    case 16:
      return dispatch_head_size<scalar_t, 16>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window,
                                              scale);
    case 32:
      return dispatch_head_size<scalar_t, 32>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window,
                                              scale);
    default:
      return run<scalar_t, 0, 0>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                           int64_t window, double scale, const std::optional<at::Tensor>& key_ends_opt) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && v_cache.dim() == 5, "bad shapes");
  const int64_t blocks = k_cache.size(0), kv_heads = k_cache.size(1), dim = q.size(2), bs = k_cache.size(3);
  TORCH_CHECK(k_cache.sizes() == at::IntArrayRef({blocks, kv_heads, dim / 2, bs, 2}) &&
                  v_cache.sizes() == at::IntArrayRef({blocks, kv_heads, bs / 2, dim, 2}) && dim % 2 == 0 && bs % 2 == 0,
              "the key cache must be [blocks, kv_heads, D / 2, block_size, 2] and the value cache [blocks, kv_heads, "
              "block_size / 2, D, 2]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "the caches and block tables must be contiguous");
  const at::Tensor qc = q.contiguous();
  at::Tensor key_ends_t;
  if (key_ends_opt.has_value()) {
    key_ends_t = key_ends_opt->contiguous();
    TORCH_CHECK(key_ends_t.scalar_type() == at::kInt && key_ends_t.numel() == q.size(0),
                "key_ends must be int32, one per query token");
  }
  const int32_t* key_ends = key_ends_t.defined() ? key_ends_t.data_ptr<int32_t>() : nullptr;
  at::Tensor out = at::empty_like(qc);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch<float>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
      break;
    case at::kBFloat16:
      dispatch<c10::BFloat16>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
      break;
    case at::kHalf:
      dispatch<c10::Half>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Stores this step's keys and values ([tokens, kv_heads, D]) at their slots, in the pair
// layouts of the caches.
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 5 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k.scalar_type() == k_cache.scalar_type(),
              "bad shapes or dtypes");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), bs = k_cache.size(3);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* kcp = k_cache.data_ptr<scalar_t>();
    scalar_t* vcp = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = sp[t] / bs, off = sp[t] % bs;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* kt = kp + (t * heads + h) * dim;
          const scalar_t* vt = vp + (t * heads + h) * dim;
          scalar_t* kb = kcp + (block * heads + h) * dim * bs + off * 2;  // [D / 2, bs, 2]
          scalar_t* vb = vcp + ((block * heads + h) * (bs / 2) + off / 2) * dim * 2 + (off & 1);  // [bs / 2, D, 2]
          for (int64_t d = 0; d < dim; ++d) {
            kb[(d / 2) * bs * 2 + (d & 1)] = kt[d];
            vb[d * 2] = vt[d];
          }
        }
      }
    });
  });
}

}  // namespace

VLMSERVE_EXPORT(write_kv_cache);
VLMSERVE_EXPORT(paged_attention);
