// Paged attention on the CPU, reading the KV cache where it lies.
//
// One call covers a whole mixed batch: decodes (one query token), prefills, and chunks of
// prefills over a cached prefix, with sliding windows and grouped-query attention. Keys
// and values stay in the cache's dtype (bf16, fp16 or fp32) and are converted as they are
// read; scores, softmax and the output accumulate in fp32 (online softmax), so nothing
// the size of a sequence is ever gathered or upcast.
//
// Layouts: q, out [tokens, q_heads, D]; key cache [blocks, kv_heads, D, block_size] (each
// block's keys transposed, so that a query's scores against a block are D vector FMAs);
// value cache [blocks, kv_heads, block_size, D] (a block of one head is contiguous, and
// the next one is prefetched while this one is computed); block_tables [seqs, max_blocks] (int32);
// query_start [seqs + 1] (int32: where each sequence's queries start in q); seq_lens [seqs]
// (int32: tokens in the cache once this step's are written, i.e. the last query's position
// + 1). Query j of a sequence with q_len queries sits at position seq_len - q_len + j and
// sees the keys at positions [max(0, pos - window + 1), pos] (window 0: no window).
//
// Work is split into (sequence, KV head, tile of query tokens) items, handed out to the
// threads one at a time from a shared counter (decodes are cheap, long prefills are not).
// Within an item, the query heads that share the KV head and the tile's tokens form the
// rows; rows are processed kRows at a time with their scores and outputs in registers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int kTileTokens = 16;  // query tokens per work item
constexpr int kRows = 4;         // rows computed together (register tile)
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
  std::vector<int32_t> lo, hi;  // per row: the visible key positions [lo, hi]
  void reserve(int64_t rows, int64_t head_dim, int64_t block_size) {
    q.assign(rows * head_dim, 0.f);
    o.assign(rows * head_dim, 0.f);
    row_max.assign(rows, kNoScore);
    row_sum.assign(rows, 0.f);
    scores.resize(rows * block_size);
    lo.resize(rows);
    hi.resize(rows);
  }
};

// scores[r][t] = q[r] . key[t] for kRows rows and one block. BS, D > 0: sizes known at
// compile time (the accumulators stay in registers); 0: read at run time.
template <int BS, int D, typename scalar_t>
inline void block_scores(const float* q, const scalar_t* keys_t, float* scores, int64_t bs_rt, int64_t d_rt) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
  if constexpr (BS > 0) {
    float acc[kRows][BS] = {};
    for (int64_t d = 0; d < dim; ++d) {
      float kd[BS];
      for (int t = 0; t < BS; ++t) kd[t] = static_cast<float>(keys_t[d * BS + t]);
      for (int r = 0; r < kRows; ++r) {
        const float qd = q[r * dim + d];
        for (int t = 0; t < BS; ++t) acc[r][t] += qd * kd[t];
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < BS; ++t) scores[r * BS + t] = acc[r][t];
  } else {
    for (int64_t i = 0; i < kRows * bs; ++i) scores[i] = 0.f;
    for (int64_t d = 0; d < dim; ++d)
      for (int r = 0; r < kRows; ++r) {
        const float qd = q[r * dim + d];
        for (int64_t t = 0; t < bs; ++t) scores[r * bs + t] += qd * static_cast<float>(keys_t[d * bs + t]);
      }
  }
}

// out[r] = out[r] * correction[r] + sum_t p[r][t] * value[t], for kRows rows and one block.
template <int BS, int D, typename scalar_t>
inline void block_values(const float* p, const float* correction, const scalar_t* values, int64_t value_stride,
                         float* out, int64_t bs_rt, int64_t d_rt) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
  if constexpr (D > 0) {
    float acc[kRows][D];
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < D; ++d) acc[r][d] = out[r * D + d] * correction[r];
    for (int64_t t = 0; t < bs; ++t) {
      float vt[D];
      for (int d = 0; d < D; ++d) vt[d] = static_cast<float>(values[t * value_stride + d]);
      for (int r = 0; r < kRows; ++r) {
        const float pt = p[r * bs + t];
        for (int d = 0; d < D; ++d) acc[r][d] += pt * vt[d];
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < D; ++d) out[r * D + d] = acc[r][d];
  } else {
    for (int r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] *= correction[r];
    for (int64_t t = 0; t < bs; ++t)
      for (int r = 0; r < kRows; ++r) {
        const float pt = p[r * bs + t];
        for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += pt * static_cast<float>(values[t * value_stride + d]);
      }
  }
}

template <typename scalar_t, int BS, int D>
void attend_item(const WorkItem& w, const scalar_t* q, scalar_t* out, const scalar_t* k_cache,
                 const scalar_t* v_cache, const int32_t* block_table, int32_t q_start, int32_t seq_len,
                 int32_t q_len, int64_t window, float scale, int64_t q_heads, int64_t kv_heads, int64_t d_rt,
                 int64_t bs_rt, Scratch& s) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  const int64_t dim = D > 0 ? D : d_rt;
  const int64_t group = q_heads / kv_heads;
  const int64_t rows = (w.q_end - w.q_begin) * group;  // row r: token r / group, head kv_head * group + r % group
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;  // padding rows see no key
  const int64_t first_pos = seq_len - q_len;
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
    for (int64_t d = 0; d < dim; ++d) s.q[r * dim + d] = static_cast<float>(src[d]) * scale;
    const int64_t pos = first_pos + w.q_begin + r / group;
    s.hi[r] = static_cast<int32_t>(pos);
    s.lo[r] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
  }
  const int64_t last_pos = first_pos + w.q_end - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + w.q_begin - window + 1) : 0;
  const int64_t value_stride = dim;  // between two tokens of a block
  const int64_t block_elems = dim * bs;  // of one head, in either cache
  float correction[kRows];
  for (int64_t b = lo / bs; b <= last_pos / bs; ++b) {
    const int64_t block = block_table[b];
    const scalar_t* keys_t = k_cache + (block * kv_heads + w.kv_head) * block_elems;
    const scalar_t* values = v_cache + (block * kv_heads + w.kv_head) * block_elems;
    if (b < last_pos / bs) {  // the next block of this head: a random place in memory
      const int64_t next = (block_table[b + 1] * kv_heads + w.kv_head) * block_elems;
      const char* nk = reinterpret_cast<const char*>(k_cache + next);
      const char* nv = reinterpret_cast<const char*>(v_cache + next);
      for (int64_t off = 0; off < block_elems * int64_t(sizeof(scalar_t)); off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    const int64_t key0 = b * bs;
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      float* sc = s.scores.data() + r0 * bs;
      block_scores<BS, D>(s.q.data() + r0 * dim, keys_t, sc, bs, dim);
      bool any = false;
      for (int r = 0; r < kRows; ++r) {
        const int64_t t0 = std::max<int64_t>(s.lo[r0 + r] - key0, 0);
        const int64_t t1 = std::min<int64_t>(s.hi[r0 + r] - key0, bs - 1);
        float* row = sc + r * bs;
        float mx = s.row_max[r0 + r];
        for (int64_t t = t0; t <= t1; ++t) mx = std::max(mx, row[t]);
        for (int64_t t = 0; t < bs; ++t) row[t] = (t >= t0 && t <= t1) ? vlmserve::exp_approx(std::min(row[t] - mx, 0.f)) : 0.f;
        float sum = 0.f;
        for (int64_t t = 0; t < bs; ++t) sum += row[t];
        correction[r] = vlmserve::exp_approx(s.row_max[r0 + r] - mx);  // 0 before the first visible key
        s.row_sum[r0 + r] = s.row_sum[r0 + r] * correction[r] + sum;
        s.row_max[r0 + r] = mx;
        any = any || t0 <= t1;
      }
      if (any) block_values<BS, D>(sc, correction, values, value_stride, s.o.data() + r0 * dim, bs, dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + w.q_begin + r / group;
    const int64_t head = w.kv_head * group + r % group;
    scalar_t* dst = out + (token * q_heads + head) * dim;
    const float inv = 1.f / s.row_sum[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(s.o[r * dim + d] * inv);
  }
}

template <typename scalar_t, int BS, int D>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
         int64_t window, double scale) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(3);
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
                                   qs[w.seq + 1] - qs[w.seq], window, static_cast<float>(scale), q_heads, kv_heads,
                                   dim, block_size, scratch);
    }
  });
}

template <typename scalar_t, int BS>
void dispatch_head_size(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                        int64_t window, double scale) {
  switch (q.size(2)) {
    case 64: return run<scalar_t, BS, 64>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
    case 128:
      return run<scalar_t, BS, 128>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
    default: return run<scalar_t, BS, 0>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
  }
}

template <typename scalar_t>
void dispatch(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens, int64_t window,
              double scale) {
  switch (k_cache.size(3)) {
    case 16:
      return dispatch_head_size<scalar_t, 16>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window,
                                              scale);
    case 32:
      return dispatch_head_size<scalar_t, 32>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window,
                                              scale);
    default:
      return run<scalar_t, 0, 0>(q, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                           int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(3) == v_cache.size(2) && k_cache.size(2) == v_cache.size(3),
              "the key cache must be [blocks, kv_heads, D, block_size] and the value cache [blocks, kv_heads, "
              "block_size, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "the caches and block tables must be contiguous");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch<float>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
      break;
    case at::kBFloat16:
      dispatch<c10::BFloat16>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
      break;
    case at::kHalf:
      dispatch<c10::Half>(qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, window, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vlmserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
        "Tensor seq_lens, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
