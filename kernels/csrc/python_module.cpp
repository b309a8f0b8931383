// The extension's Python module (cpu_extension.cpu_kernels()): one function per kernel.
//
// From Python, a call through torch.ops boxes every argument into the dispatcher's stack and
// back: 14 us a call against 5 us for a binding like these on an AMD EPYC (an RMSNorm of one
// row), 180 against 101 us after a stream of weights has pushed that code out of the
// caches, which is what a decode step does before each of its ~12 kernel calls a layer.
// Each function is called with the GIL released and shows in torch's profiler as
// vlmserve_cpu::<name>, as an op would. Only this file includes Python's and pybind11's
// headers (they double a kernel file's compile time).
#include <ATen/record_function.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl_bind.h>

#include <stdexcept>

#include <string>
#include <utility>
#include <vector>

#include "kernels.h"

// a decoder's layers, built once in Python, passed to decode_layers by reference
PYBIND11_MAKE_OPAQUE(std::vector<vlmserve::cpu_kernels::DecodeLayer>)

namespace {

namespace py = pybind11;

template <typename R, typename... A>
void def(py::module_& m, const char* name, R (*fn)(A...)) {
  m.def(
      name,
      [fn, traced = std::string("vlmserve_cpu::") + name](A... args) -> R {
        RECORD_FUNCTION(traced.c_str(), std::vector<c10::IValue>());
        return fn(std::forward<A>(args)...);
      },
      py::call_guard<py::gil_scoped_release>());
}

void def_decode_layer_types(py::module_& m) {
  namespace k = vlmserve::cpu_kernels;
  using Tensor = k::Tensor;
  using Optional = k::OptionalTensor;
  py::class_<k::DecodeLinear>(m, "DecodeLinear")
      .def(py::init([](const std::string& kind, Tensor weight, Optional scales, Optional zeros, Optional bias) {
             const auto code = kind == "bf16" ? k::DecodeLinear::kBf16
                               : kind == "int8" ? k::DecodeLinear::kInt8
                               : kind == "int4" ? k::DecodeLinear::kInt4
                               : kind == "pairs" ? k::DecodeLinear::kPairs
                                                : throw std::invalid_argument("DecodeLinear: unknown kind " + kind);
             return k::DecodeLinear{code, std::move(weight), std::move(scales), std::move(zeros), std::move(bias)};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("bias") = py::none());
  py::class_<k::DecodeLayer>(m, "DecodeLayer")
      .def(py::init([](Tensor input_norm, Tensor post_attention_norm, Optional q_norm, Optional k_norm,
                       k::DecodeLinear qkv, k::DecodeLinear o, k::DecodeLinear gate_up, k::DecodeLinear down,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                       double k_scale, double v_scale) {
             return k::DecodeLayer{std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                                   std::move(k_norm), std::move(qkv), std::move(o), std::move(gate_up),
                                   std::move(down), num_heads, num_kv_heads, head_dim, scale, eps, k_scale, v_scale};
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"),
           py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  py::bind_vector<std::vector<k::DecodeLayer>>(m, "DecodeLayers");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace k = vlmserve::cpu_kernels;
  def(m, "rms_norm", k::rms_norm);
  def(m, "add_rms_norm", k::add_rms_norm);
  def(m, "apply_rotary", k::apply_rotary);
  def(m, "silu_and_mul", k::silu_and_mul);
  def(m, "write_kv_cache", k::write_kv_cache);
  def(m, "paged_attention", k::paged_attention);
  def(m, "varlen_attention", k::varlen_attention);
  def(m, "bf16_gemv", k::bf16_gemv);
  def(m, "int8_gemv", k::int8_gemv);
  def(m, "int8_tiled_gemv", k::int8_tiled_gemv);
  def(m, "int8_tiled_dequantize", k::int8_tiled_dequantize);
  def(m, "int4_gemv", k::int4_gemv);
  def(m, "int4_dequantize", k::int4_dequantize);
  def(m, "fp8_gemv", k::fp8_gemv);
  def(m, "fp8_dequantize", k::fp8_dequantize);
  def(m, "set_gemv_streams", k::set_gemv_streams);
  def(m, "gemv_streams", k::gemv_streams);
  def(m, "bf16_pair_pack", k::bf16_pair_pack);
  def(m, "bf16_batch_linear", k::bf16_batch_linear);
  def(m, "amx_linear", k::amx_linear);
  def(m, "amx_ready", k::amx_ready);
  def(m, "gated_delta_rule", k::gated_delta_rule);
  def(m, "causal_conv1d", k::causal_conv1d);
  def(m, "apply_token_bitmask", k::apply_token_bitmask);
  def(m, "argmax_rows", k::argmax_rows);
  def_decode_layer_types(m);
  def(m, "decode_layers", k::decode_layers);
}
