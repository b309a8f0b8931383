// Paged attention's work items (paged_attention.cpp has the layouts): one (sequence, KV
// head, tile of query tokens) at a time, over the blocks of a cache whose elements are the
// queries' dtype, or FP8 (kv_fp8.h: each block widened as it is read, its scales folded into
// the scores' scale and the outputs). paged_attention.cpp runs the first, and
// paged_attention_fp8.cpp the second, each compiled on its own.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_attention_bf16.h"
#include "paged_attention_blocks.h"

namespace vlmserve::paged {

constexpr int kTileTokens = 16;  // query tokens per work item

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;  // query tokens [q_begin, q_end) of the sequence
  int32_t q_end;
};

// One call's tensors and settings
struct Call {
  const at::Tensor& q;
  at::Tensor& out;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& block_tables;
  const at::Tensor& query_start;
  const at::Tensor& seq_lens;
  const int32_t* key_ends;
  int64_t window;
  double scale;   // of the scores (an FP8 cache's: times its keys' scale)
  float v_scale;  // an FP8 cache's values' scale, applied to the outputs
};

// The caches of paged_attention_fp8.cpp: FP8 keys and values in the queries' layout
void attend_fp8(const Call& c);
void write_kv_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        const int64_t* slots, double k_scale, double v_scale);

// The rows' outputs, divided by their softmax sums (and times an FP8 cache's values' scale), into out
template <typename scalar_t, typename cache_t, int BS, int D>
VLMSERVE_INLINE void store_rows(const WorkItem& w, scalar_t* out, int32_t q_start, int64_t group, int64_t rows,
                                int64_t q_heads, int64_t dim, float v_scale, const Scratch& s) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + w.q_begin + r / group;
    const int64_t head = w.kv_head * group + r % group;
    scalar_t* dst = out + (token * q_heads + head) * dim;
    float inv;
    if constexpr (HeadBlocks<scalar_t, cache_t>::kWidened)
      inv = v_scale / s.row_sum[r];
    else
      inv = 1.f / s.row_sum[r];
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

// Each row's query (scaled to fp32, or the bf16 pairs the dot products take) and the key
// positions it sees [lo, hi] into s; returns the last key any row sees.
template <typename scalar_t, int BS, int D>
VLMSERVE_INLINE int64_t load_rows(const WorkItem& w, const scalar_t* q, int32_t q_start, int64_t first_pos,
                                  int32_t seq_len, const int32_t* key_ends, int64_t window, float scale,
                                  int64_t q_heads, int64_t group, int64_t rows, int64_t padded, int64_t dim,
                                  Scratch& s) {
  int64_t last_key = 0;
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
  return last_key;
}

template <typename scalar_t, typename cache_t, int BS, int D>
void attend_item(const WorkItem& w, const scalar_t* q, scalar_t* out, const cache_t* k_cache,
                 const cache_t* v_cache, const int32_t* block_table, int32_t q_start, int32_t seq_len,
                 int32_t q_len, const int32_t* key_ends, int64_t window, float scale, float v_scale, int64_t q_heads,
                 int64_t kv_heads, int64_t d_rt, int64_t bs_rt, Scratch& s) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
  const int64_t group = q_heads / kv_heads;
  const int64_t rows = (w.q_end - w.q_begin) * group;  // row r: token r / group, head kv_head * group + r % group
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;  // padding rows see no key
  const int64_t first_pos = seq_len - q_len;
  s.reserve(padded, dim, bs);
  const int64_t last_pos = load_rows<scalar_t, BS, D>(w, q, q_start, first_pos, seq_len, key_ends, window, scale,
                                                     q_heads, group, rows, padded, dim, s);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + w.q_begin - window + 1) : 0;
  const int64_t block_elems = dim * bs;  // of one head, in either cache
  using Blocks = HeadBlocks<scalar_t, cache_t>;
  const Blocks blocks{k_cache, v_cache, kv_heads, w.kv_head, block_elems,
                      Blocks::kWidened ? s.widened_blocks<scalar_t>(block_elems) : nullptr};
  float correction[kRows];
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dot<scalar_t, BS, D>) {
    attend_block_pairs<scalar_t, BS, D>(blocks, block_table, lo, last_pos, padded, scale, correction, s);
  } else
#endif
  for (int64_t b = lo / bs; b <= last_pos / bs; ++b) {
    const auto [keys, values] = blocks.at(block_table[b], 0);
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
  store_rows<scalar_t, cache_t, BS, D>(w, out, q_start, group, rows, q_heads, dim, v_scale, s);
}

template <typename scalar_t, typename cache_t, int BS, int D>
void run(const Call& c) {
  const int64_t num_seqs = c.seq_lens.size(0);
  const int64_t q_heads = c.q.size(1), dim = c.q.size(2);
  const int64_t kv_heads = c.k_cache.size(1), block_size = c.k_cache.size(3);  // keys [blocks, heads, D / 2, bs, 2]
  const int32_t* qs = c.query_start.data_ptr<int32_t>();
  const int32_t* sl = c.seq_lens.data_ptr<int32_t>();
  const int32_t* bt = c.block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = c.block_tables.size(1);
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
  const scalar_t* qp = c.q.data_ptr<scalar_t>();
  scalar_t* op = c.out.data_ptr<scalar_t>();
  const cache_t* kp = c.k_cache.data_ptr<cache_t>();
  const cache_t* vp = c.v_cache.data_ptr<cache_t>();
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const WorkItem& w = items[i];
      attend_item<scalar_t, cache_t, BS, D>(w, qp, op, kp, vp, bt + w.seq * bt_stride, qs[w.seq], sl[w.seq],
                                            qs[w.seq + 1] - qs[w.seq], c.key_ends, c.window,
                                            static_cast<float>(c.scale), c.v_scale, q_heads, kv_heads, dim,
                                            block_size, scratch);
    }
  });
}

// run with the block size and head size compiled in where they are common ones
template <typename scalar_t, typename cache_t>
void dispatch(const Call& c) {
  auto by_head_size = [&](auto block_size) {
    constexpr int BS = decltype(block_size)::value;
    switch (c.q.size(2)) {
      case 64: return run<scalar_t, cache_t, BS, 64>(c);
      case 128: return run<scalar_t, cache_t, BS, 128>(c);
      case 256: return run<scalar_t, cache_t, BS, 256>(c);  // Qwen3.5, Gemma 3
      default: return run<scalar_t, cache_t, BS, 0>(c);
    }
  };
  switch (c.k_cache.size(3)) {  // the block size
    case 16: return by_head_size(std::integral_constant<int, 16>{});
    case 32: return by_head_size(std::integral_constant<int, 32>{});
    default: return run<scalar_t, cache_t, 0, 0>(c);
  }
}

}  // namespace vlmserve::paged
