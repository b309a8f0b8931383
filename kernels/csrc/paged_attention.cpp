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
//
// The steps over one block for those rows: paged_attention_blocks.h (portable and AVX2) and
// paged_attention_bf16.h (AVX512-BF16, two blocks at a time).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_attention_blocks.h"
#include "paged_attention_bf16.h"
#include "kernels.h"

namespace {

using vlmserve::paged::kBf16Dot;
using vlmserve::paged::kPrefetchBlocks;
using vlmserve::paged::kRows;
using vlmserve::paged::Scratch;

constexpr int kTileTokens = 16;  // query tokens per work item

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;  // query tokens [q_begin, q_end) of the sequence
  int32_t q_end;
};

// The rows' outputs, divided by their softmax sums, into out
template <typename scalar_t, int BS, int D>
VLMSERVE_INLINE void store_rows(const WorkItem& w, scalar_t* out, int32_t q_start, int64_t group, int64_t rows,
                                int64_t q_heads, int64_t dim, const Scratch& s) {
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
  s.reserve(padded, dim, bs);
  const int64_t last_pos = load_rows<scalar_t, BS, D>(w, q, q_start, first_pos, seq_len, key_ends, window, scale,
                                                     q_heads, group, rows, padded, dim, s);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + w.q_begin - window + 1) : 0;
  const int64_t block_elems = dim * bs;  // of one head, in either cache
  float correction[kRows];
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dot<scalar_t, BS, D>) {
    vlmserve::paged::attend_block_pairs<scalar_t, BS, D>(k_cache, v_cache, block_table, kv_heads, w.kv_head,
                                                         block_elems, lo, last_pos, padded, scale, correction, s);
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
    vlmserve::paged::ask_for_blocks(k_cache, v_cache, block_table, b + 1, std::min(b + kPrefetchBlocks, last_pos / bs),
                                    kv_heads, w.kv_head, block_elems);
    const int64_t key0 = b * bs;
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      float* sc = s.scores.data() + r0 * bs;
      vlmserve::paged::block_scores<BS, D>(s.q.data() + r0 * dim, keys, sc, bs, dim);
      const bool any = vlmserve::paged::block_softmax<scalar_t, BS, D>(sc, s.lo.data() + r0, s.hi.data() + r0, key0,
                                                                       s.row_max.data() + r0, s.row_sum.data() + r0,
                                                                       correction, bs);
      if (!any) continue;
      vlmserve::paged::block_values<BS, D>(sc, correction, values, s.o.data() + r0 * dim, bs, dim);
    }
  }
  store_rows<scalar_t, BS, D>(w, out, q_start, group, rows, q_heads, dim, s);
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
