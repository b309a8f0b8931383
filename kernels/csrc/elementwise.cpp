// The elementwise work of a decoder layer, one pass each instead of torch's chain of
// small ops (each its own pass over memory): RMSNorm (plain, zero-centred, gated by
// silu), rotary embedding in the rotate-half layout, and silu(gate) * up. Everything is
// computed in fp32 and rounded once to the output dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "vec_math.h"
#include "kernels.h"

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task

// out = norm(x) * w, where w = weight (plain), 1 + weight (zero-centred); times silu(gate)
// when a gate is given (the output norm of a Gated DeltaNet layer). The weight is read in
// its own dtype (x's or fp32): converting it first is a copy per call, per layer and step.
template <typename scalar_t, typename weight_t>
void rms_norm_rows(const scalar_t* xp, const weight_t* wp, const scalar_t* gp, scalar_t* op, int64_t rows,
                   int64_t dim, float eps, float offset) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * dim;
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      scalar_t* orow = op + r * dim;
      if (gp == nullptr) {
        for (int64_t i = 0; i < dim; ++i)
          orow[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) * scale * (static_cast<float>(wp[i]) + offset));
      } else {
        const scalar_t* gr = gp + r * dim;
        for (int64_t i = 0; i < dim; ++i)
          orow[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) * scale * (static_cast<float>(wp[i]) + offset) *
                                          vlmserve::silu(static_cast<float>(gr[i])));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered,
                    const c10::optional<at::Tensor>& gate) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "weight must have the size of the last dimension");
  const at::Tensor xc = x.contiguous();
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  const at::Tensor w = (fp32_weight ? weight : weight.to(x.scalar_type())).contiguous();
  at::Tensor gc;
  if (gate.has_value()) {
    gc = gate->contiguous();
    TORCH_CHECK(gc.sizes() == x.sizes() && gc.scalar_type() == x.scalar_type(), "gate must be like x");
  }
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / dim;
  const float offset = zero_centered ? 1.f : 0.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* gp = gate.has_value() ? gc.data_ptr<scalar_t>() : nullptr;
    if (fp32_weight)
      rms_norm_rows(xc.data_ptr<scalar_t>(), w.data_ptr<float>(), gp, out.data_ptr<scalar_t>(), rows, dim,
                    static_cast<float>(eps), offset);
    else
      rms_norm_rows(xc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), gp, out.data_ptr<scalar_t>(), rows, dim,
                    static_cast<float>(eps), offset);
  });
  return out;
}

// (x + delta, norm(x + delta)) in one pass: a decoder layer's residual sum, rounded to x's
// dtype as the reference's addition rounds it, and the next norm of that rounded sum
// (plain or zero-centred weight, read in its own dtype). Saves the addition's own pass
// over both tensors and the norm's read of the sum.
template <typename scalar_t, typename weight_t>
void add_rms_norm_rows(const scalar_t* xp, const scalar_t* dp, const weight_t* wp, scalar_t* sp, scalar_t* op,
                       int64_t rows, int64_t dim, float eps, float offset) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * dim;
      const scalar_t* dr = dp + r * dim;
      scalar_t* srow = sp + r * dim;
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        srow[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
        const float v = static_cast<float>(srow[i]);
        ss += v * v;
      }
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      scalar_t* orow = op + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        orow[i] = static_cast<scalar_t>(static_cast<float>(srow[i]) * scale * (static_cast<float>(wp[i]) + offset));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps, bool zero_centered) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "weight must have the size of the last dimension");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "delta must be like x");
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous();
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  const at::Tensor w = (fp32_weight ? weight : weight.to(x.scalar_type())).contiguous();
  at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
  const int64_t rows = xc.numel() / dim;
  const float offset = zero_centered ? 1.f : 0.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    if (fp32_weight)
      add_rms_norm_rows(xc.data_ptr<scalar_t>(), dc.data_ptr<scalar_t>(), w.data_ptr<float>(),
                        sum.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), offset);
    else
      add_rms_norm_rows(xc.data_ptr<scalar_t>(), dc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                        sum.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), offset);
  });
  return {sum, out};
}

// x [tokens, heads, head_dim] at strides (token_stride, head_stride, 1): q or k as views of
// the fused projection's output, not copied first; cos, sin [tokens, rot] (rot <= head_dim,
// even; x's dtype or fp32, read as they are): the first rot channels of each head rotated
// (rotate-half pairs i, i + rot / 2), the rest kept; out is contiguous. A token's table
// row is widened to fp32 once, for all its heads: converting it inside the head loop kept
// the compiler from vectorising (3.5x slower with the bf16 tables the models use, rounded
// as the reference rounds them).
template <typename scalar_t, typename table_t>
void rotate_rows(const scalar_t* xp, int64_t token_stride, int64_t head_stride, const table_t* cp,
                 const table_t* sp, scalar_t* op, int64_t tokens, int64_t heads, int64_t dim, int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> table(2 * rot);
    float* c = table.data();
    float* s = c + rot;
    for (int64_t t = begin; t < end; ++t) {
      const table_t* ct = cp + t * rot;
      const table_t* st = sp + t * rot;
      for (int64_t i = 0; i < rot; ++i) {
        c[i] = static_cast<float>(ct[i]);
        s[i] = static_cast<float>(st[i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* xr = xp + t * token_stride + h * head_stride;
        scalar_t* orow = op + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(xr[i]), b = static_cast<float>(xr[i + half]);
          orow[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
          orow[i + half] = static_cast<scalar_t>(b * c[i + half] + a * s[i + half]);
        }
        for (int64_t i = rot; i < dim; ++i) orow[i] = xr[i];
      }
    }
  });
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "x must be [tokens, heads, head_dim] and cos/sin [tokens, rot]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rot = cos.size(1);
  TORCH_CHECK(rot <= dim && rot % 2 == 0, "bad rotary size");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "cos and sin must have one dtype");
  // the last dimension must be dense; the tokens and heads may be strided
  const at::Tensor xc = x.stride(2) == 1 ? x : x.contiguous();
  const bool fp32_tables = cos.scalar_type() == at::kFloat;
  const auto table = [&](const at::Tensor& t) { return (fp32_tables ? t : t.to(x.scalar_type())).contiguous(); };
  const at::Tensor cc = table(cos), sc = table(sin);
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_rotary", [&] {
    if (fp32_tables)
      rotate_rows(xc.data_ptr<scalar_t>(), xc.stride(0), xc.stride(1), cc.data_ptr<float>(), sc.data_ptr<float>(),
                  out.data_ptr<scalar_t>(), tokens, heads, dim, rot);
    else
      rotate_rows(xc.data_ptr<scalar_t>(), xc.stride(0), xc.stride(1), cc.data_ptr<scalar_t>(),
                  sc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, heads, dim, rot);
  });
  return out;
}

// gate_up [rows, 2 * n] (gate, then up) -> silu(gate) * up [rows, n]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t n = gate_up.size(-1) / 2;
  const at::Tensor gc = gate_up.contiguous();
  auto sizes = gc.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gc.options());
  const int64_t rows = gc.numel() / (2 * n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * 2 * n;
        const scalar_t* u = g + n;
        scalar_t* o = op + r * n;
        for (int64_t i = 0; i < n; ++i)
          o[i] = static_cast<scalar_t>(vlmserve::silu(static_cast<float>(g[i])) * static_cast<float>(u[i]));
      }
    });
  });
  return out;
}

}  // namespace

VLMSERVE_EXPORT(rms_norm);
VLMSERVE_EXPORT(add_rms_norm);
VLMSERVE_EXPORT(apply_rotary);
VLMSERVE_EXPORT(silu_and_mul);
