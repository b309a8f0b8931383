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
// The work items and their steps: paged_attention_items.h; the steps over one block for
// those rows: paged_attention_blocks.h (portable and AVX2) and paged_attention_bf16.h
// (AVX512-BF16, two blocks at a time). FP8 caches (float8 e4m3fn, with a scale for the keys
// and one for the values, vLLM's per-tensor scales): paged_attention_fp8.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "paged_attention_items.h"

namespace {

namespace paged = vlmserve::paged;

// k_scale, v_scale: an FP8 cache's scales (a value is its byte's number times the scale);
// other caches ignore them.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                           int64_t window, double scale, const std::optional<at::Tensor>& key_ends_opt, double k_scale,
                           double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && v_cache.dim() == 5, "bad shapes");
  const int64_t blocks = k_cache.size(0), kv_heads = k_cache.size(1), dim = q.size(2), bs = k_cache.size(3);
  TORCH_CHECK(k_cache.sizes() == at::IntArrayRef({blocks, kv_heads, dim / 2, bs, 2}) &&
                  v_cache.sizes() == at::IntArrayRef({blocks, kv_heads, bs / 2, dim, 2}) && dim % 2 == 0 && bs % 2 == 0,
              "the key cache must be [blocks, kv_heads, D / 2, block_size, 2] and the value cache [blocks, kv_heads, "
              "block_size / 2, D, 2]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((fp8 || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must share q's dtype, or both be float8_e4m3fn");
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
  const paged::Call call{qc, out, k_cache, v_cache, block_tables, query_start, seq_lens, key_ends, window,
                         fp8 ? scale * k_scale : scale, static_cast<float>(v_scale)};
  if (fp8) {
    paged::attend_fp8(call);
    return out;
  }
  switch (q.scalar_type()) {
    case at::kFloat: paged::dispatch<float, float>(call); break;
    case at::kBFloat16: paged::dispatch<c10::BFloat16, c10::BFloat16>(call); break;
    case at::kHalf: paged::dispatch<c10::Half, c10::Half>(call); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Stores this step's keys and values ([tokens, kv_heads, D]) at their slots, in the pair
// layouts of the caches; into FP8 caches divided by k_scale and v_scale (kv_fp8.h).
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 5 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && (fp8 || k.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "bad shapes or dtypes");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), bs = k_cache.size(3);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (fp8) return paged::write_kv_cache_fp8(kc, vc, k_cache, v_cache, sp, k_scale, v_scale);
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
