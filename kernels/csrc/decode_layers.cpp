// One decode step of a Qwen-style decoder's layers in one call: for each layer, the norm,
// the fused q/k/v projection, the rotary (after a norm of each head's queries and keys
// where the layer has one), the KV cache write, paged attention, the output projection,
// the residual sum and the next norm, the fused gate/up projection, silu(gate) * up and the
// down projection; the same kernels, in the same order, as the layers' Python forward.
//
// Why: a decode step streams every weight once, and each stream pushes everything else out
// of the caches. Run from Python, each of a layer's dozen kernel calls then starts by
// fetching the interpreter's and torch's state from memory again: 0.15-0.2 ms a projection
// on an AMD EPYC, 5-10% of a step. From here, between two projections only these few lines
// and the kernels' own small inputs are fetched again.
#include <vector>

#include "kernels.h"

namespace {

using vlmserve::cpu_kernels::DecodeLayer;
using vlmserve::cpu_kernels::DecodeLinear;
using vlmserve::cpu_kernels::OptionalTensor;
using vlmserve::cpu_kernels::Tensor;
namespace k = vlmserve::cpu_kernels;

Tensor project(const Tensor& x, const DecodeLinear& p) {
  switch (p.kind) {
    case DecodeLinear::kBf16:
      return k::bf16_gemv(x, p.weight, p.bias);
    case DecodeLinear::kInt8:
      return k::int8_tiled_gemv(x, p.weight, *p.scales, p.bias);
    case DecodeLinear::kInt4:
      return k::int4_gemv(x, p.weight, *p.scales, *p.zeros, p.bias);
    case DecodeLinear::kPairs:
      return k::bf16_batch_linear(x, p.weight, p.bias);
  }
  TORCH_CHECK(false, "decode_layers: unknown projection kind ", p.kind);
}

// a layer's attention of h (its input, normed) through the output projection
Tensor attention(const DecodeLayer& layer, const Tensor& h, const Tensor& cos, const Tensor& sin,
                 Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping, const Tensor& block_tables,
                 const Tensor& query_start, const Tensor& seq_lens, int64_t window) {
  const int64_t n = h.size(0), d = layer.head_dim;
  const int64_t q_size = layer.num_heads * d, kv_size = layer.num_kv_heads * d;
  const auto parts = project(h, layer.qkv).split_with_sizes({q_size, kv_size, kv_size}, -1);
  Tensor q = parts[0].view({n, layer.num_heads, d});
  Tensor key = parts[1].view({n, layer.num_kv_heads, d});
  if (layer.q_norm) {
    q = k::rms_norm(q, *layer.q_norm, layer.eps, false, std::nullopt);
    key = k::rms_norm(key, *layer.k_norm, layer.eps, false, std::nullopt);
  }
  q = k::apply_rotary(q, cos, sin);
  key = k::apply_rotary(key, cos, sin);
  k::write_kv_cache(key, parts[2].view({n, layer.num_kv_heads, d}), k_cache, v_cache, slot_mapping, layer.k_scale,
                    layer.v_scale);
  const Tensor out = k::paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, window,
                                        layer.scale, std::nullopt, layer.k_scale, layer.v_scale);
  return project(out.reshape({n, q_size}), layer.o);
}

std::tuple<Tensor, Tensor> decode_layers(const std::vector<DecodeLayer>& layers, const Tensor& x,
                                         const OptionalTensor& delta, const Tensor& cos, const Tensor& sin,
                                         const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
                                         const Tensor& slot_mapping, const Tensor& block_tables,
                                         const Tensor& query_start, const Tensor& seq_lens, int64_t window) {
  TORCH_CHECK(!layers.empty() && k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "decode_layers: one key and one value cache per layer");
  Tensor hidden = x, h;
  OptionalTensor carried = delta;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayer& layer = layers[i];
    if (carried) {
      std::tie(hidden, h) = k::add_rms_norm(hidden, *carried, layer.input_norm, layer.eps, false);
    } else {
      h = k::rms_norm(hidden, layer.input_norm, layer.eps, false, std::nullopt);
    }
    Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    const Tensor attended = attention(layer, h, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                      query_start, seq_lens, window);
    std::tie(hidden, h) = k::add_rms_norm(hidden, attended, layer.post_attention_norm, layer.eps, false);
    carried = project(k::silu_and_mul(project(h, layer.gate_up)), layer.down);
  }
  return {hidden, *carried};
}

}  // namespace

VLMSERVE_EXPORT(decode_layers);
