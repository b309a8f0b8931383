// The kernels' entry points, for the extension's Python module (python_module.cpp). Each
// kernel file defines its entry point in an unnamed namespace, as its helpers, and exports
// its address here (VLMSERVE_EXPORT); the declared type is checked against it there.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace vlmserve::cpu_kernels {

using Tensor = at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;

// elementwise.cpp
extern Tensor (*const rms_norm)(const Tensor& x, const Tensor& weight, double eps, bool zero_centered,
                                const OptionalTensor& gate);
extern std::tuple<Tensor, Tensor> (*const add_rms_norm)(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                        double eps, bool zero_centered);
extern Tensor (*const apply_rotary)(const Tensor& x, const Tensor& cos, const Tensor& sin);
extern Tensor (*const silu_and_mul)(const Tensor& gate_up);

// paged_attention.cpp (k_scale, v_scale: an FP8 cache's; other caches ignore them)
extern void (*const write_kv_cache)(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                                    const Tensor& slot_mapping, double k_scale, double v_scale);
extern Tensor (*const paged_attention)(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       const Tensor& block_tables, const Tensor& query_start, const Tensor& seq_lens,
                                       int64_t window, double scale, const OptionalTensor& key_ends, double k_scale,
                                       double v_scale);

// varlen_attention.cpp
extern Tensor (*const varlen_attention)(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                                        double scale);

// gemv_bf16.cpp, gemv_int8.cpp, gemv_int4.cpp, gemv_fp8.cpp (one a weight format) and gemv_common.cpp
extern Tensor (*const bf16_gemv)(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);
extern Tensor (*const int8_gemv)(const Tensor& x, const Tensor& weight, const Tensor& scales,
                                 const OptionalTensor& bias);
extern Tensor (*const int8_tiled_gemv)(const Tensor& x, const Tensor& weight, const Tensor& scales,
                                       const OptionalTensor& bias);
extern void (*const int8_tiled_dequantize)(const Tensor& weight, const Tensor& scales, Tensor& out);
extern Tensor (*const int4_gemv)(const Tensor& x, const Tensor& weight, const Tensor& scales, const Tensor& zeros,
                                 const OptionalTensor& bias);
extern void (*const int4_dequantize)(const Tensor& weight, const Tensor& scales, const Tensor& zeros, Tensor& out);
extern Tensor (*const fp8_gemv)(const Tensor& x, const Tensor& weight, const Tensor& scales,
                                const OptionalTensor& bias);
extern void (*const fp8_dequantize)(const Tensor& weight, const Tensor& scales, Tensor& out);
extern void (*const set_gemv_streams)(bool several);  // set by CPU family (cpu_extension.py)
extern bool (*const gemv_streams)();

// bf16_batch_linear.cpp
extern void (*const bf16_pair_pack)(const Tensor& weight, Tensor& out);
extern Tensor (*const bf16_batch_linear)(const Tensor& x, const Tensor& packed, const OptionalTensor& bias);

// amx_linear.cpp
extern Tensor (*const amx_linear)(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);
extern bool (*const amx_ready)();

// gdn.cpp
extern Tensor (*const gated_delta_rule)(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, Tensor& state, const Tensor& query_start,
                                        const Tensor& slots, const Tensor& has_state, const Tensor& checkpoints);
extern Tensor (*const causal_conv1d)(const Tensor& x, const Tensor& weight, Tensor& conv_state,
                                     const Tensor& query_start, const Tensor& slots, const Tensor& has_state,
                                     const Tensor& checkpoints);

// decode_layers.cpp: a projection's weight in the form its one-row kernel reads
struct DecodeLinear {
  // bf16_gemv, int8_tiled_gemv, int4_gemv, bf16_batch_linear (its weight a bf16_pair_pack copy)
  enum Kind : int64_t { kBf16 = 0, kInt8 = 1, kInt4 = 2, kPairs = 3 };
  int64_t kind;
  Tensor weight;
  OptionalTensor scales, zeros, bias;
};
// a Qwen-style decoder layer's weights (q_norm and k_norm: a norm of each head's queries and keys)
struct DecodeLayer {
  Tensor input_norm, post_attention_norm;
  OptionalTensor q_norm, k_norm;
  DecodeLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim;
  double scale, eps;
  double k_scale = 1.0, v_scale = 1.0;  // an FP8 KV cache's
};
extern std::tuple<Tensor, Tensor> (*const decode_layers)(
    const std::vector<DecodeLayer>& layers, const Tensor& x, const OptionalTensor& delta, const Tensor& cos,
    const Tensor& sin, const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& query_start, const Tensor& seq_lens,
    int64_t window);

// sampling.cpp
extern void (*const apply_token_bitmask)(Tensor logits, const Tensor& rows, const Tensor& bitmask);
extern Tensor (*const argmax_rows)(const Tensor& logits);

}  // namespace vlmserve::cpu_kernels

// After a kernel file's unnamed namespace: its entry point `name`, exported under kernels.h's declaration.
#define VLMSERVE_EXPORT(name) decltype(&::name) const vlmserve::cpu_kernels::name = &::name
