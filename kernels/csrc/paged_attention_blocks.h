// Paged attention's steps over one block of the KV cache for kRows rows (paged_attention.cpp
// has the layouts): the scores, the online softmax and the values, portable (sizes known at
// compile time or not) or on AVX2 (paged_attention_avx2.h); the AVX512-BF16 path's steps
// over two blocks at once are paged_attention_bf16.h's. Each helper has internal linkage and
// is inlined into the one kernel that includes it, as when they were one file.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "paged_attention_avx2.h"
#endif

#include "kv_fp8.h"
#include "vec_math.h"

// The bf16 path's helpers hold their operands in registers only when inlined: without
// the attribute GCC called them (its growth limits for this file), the arrays of scores
// went through memory and a prompt chunk's call took 1.6x as long (measured). A work item's
// steps (paged_attention.cpp) are inlined so too: one function, as they were written.
#define VLMSERVE_INLINE static inline __attribute__((always_inline))

namespace vlmserve::paged {

constexpr int kRows = 4;         // rows computed together (register tile)
constexpr int kReadAheadRows = 12;
constexpr int64_t kPrefetchBlocks = 2;  // blocks of keys and values asked for ahead of the one in use
// the running maximum of a row before any key (exp_approx of anything below -87 is 0)
constexpr float kNoScore = -1e30f;

// A thread's buffers for the rows of one work item at a time
struct Scratch {
  std::vector<float> q, o, row_max, row_sum, scores;
  std::vector<uint32_t> q_pairs, p_pairs;  // bf16 pairs, for the AVX512-BF16 path
  std::vector<int32_t> lo, hi;  // per row: the visible key positions [lo, hi]
  std::vector<uint64_t> widened;  // an FP8 cache's blocks in the queries' dtype (HeadBlocks)
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
  // room for two blocks' keys and values of block_elems each, in T
  template <typename T>
  T* widened_blocks(int64_t block_elems) {
    widened.resize((4 * block_elems * int64_t(sizeof(T)) + 7) / 8);
    return reinterpret_cast<T*>(widened.data());
  }
};

// One KV head's keys and values of a block, in the queries' dtype scalar_t: where they lie
// in a cache of that dtype, or (an FP8 cache, kv_fp8.h) widened into the thread's scratch,
// which holds two blocks (`slot` 0 or 1: the AVX512-BF16 path reads two at once).
template <typename scalar_t, typename cache_t>
struct HeadBlocks {
  static constexpr bool kWidened = !std::is_same_v<scalar_t, cache_t>;
  const cache_t* k_cache;
  const cache_t* v_cache;
  int64_t kv_heads, kv_head, block_elems;
  scalar_t* scratch;  // kWidened only

  std::pair<const scalar_t*, const scalar_t*> at(int64_t block, int slot) const {
    const int64_t start = (block * kv_heads + kv_head) * block_elems;
    if constexpr (kWidened) {
      scalar_t* keys = scratch + 2 * slot * block_elems;
      vlmserve::fp8::widen(k_cache + start, keys, block_elems);
      vlmserve::fp8::widen(v_cache + start, keys + block_elems, block_elems);
      return {keys, keys + block_elems};
    } else {
      return {k_cache + start, v_cache + start};
    }
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
static inline void block_scores(const float* q, const scalar_t* keys, float* scores, int64_t bs_rt, int64_t d_rt) {
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
static inline void block_values(const float* p, const float* correction, const scalar_t* values,
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

// Online softmax over one block for kRows rows: scores become p = exp(score - max) where
// the key is visible (0 elsewhere), and each row's running max and sum move on; the
// factor earlier outputs must be rescaled by goes to `correction` (the bf16 path:
// two_block_softmax). Returns whether any row sees a key of the block.
template <typename scalar_t, int BS, int D>
static inline bool block_softmax(float* sc, const int32_t* lo, const int32_t* hi, int64_t key0, float* row_max,
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

// Asks for the keys and values of one head's blocks [first, last] of a sequence (each a
// random place in memory) to be brought into cache.
template <typename scalar_t>
static inline void ask_for_blocks(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_table,
                                  int64_t first, int64_t last, int64_t kv_heads, int64_t kv_head, int64_t block_elems) {
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

}  // namespace vlmserve::paged
