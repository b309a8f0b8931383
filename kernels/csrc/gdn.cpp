// Gated DeltaNet on the CPU: the causal depthwise conv1d in front of the layer and the
// gated delta rule, for a whole mixed batch (decodes and prefills, fresh or resuming a
// state) in one call each, updating the recurrent states in their slots in place.
//
// The delta rule runs as the recurrence itself, token by token, per (sequence, value
// head): the [dk, dv] fp32 state of one head (16 KB at 64 x 64) stays in the core's L1
// cache for the whole sequence, so a token costs two passes over it and nothing else is
// materialised (the chunked form trades this for matrix products and a triangular solve
// per chunk, which only pay off on a GPU). Per token, with q and k L2-normalised and q
// scaled by dk^-1/2:
//     S <- S * exp(g);   S <- S + k (beta (v - k^T S))^T;   o = q^T S
//
// Layouts: q, k [tokens, key_heads, dk]; v, out [tokens, value_heads, dv]; g (log decay)
// and beta [tokens, value_heads] (fp32); state [slots, value_heads, dk, dv] (fp32); each
// key head serves value_heads / key_heads consecutive value heads. The conv: x, out
// [tokens, channels]; weight [channels, kernel]; conv state [slots, channels, kernel - 1]
// (the inputs before the sequence's next token). query_start [seqs + 1] (int32), slots
// [seqs] (int64), has_state [seqs] (bool: resume the slot's state, else start from zeros).
// checkpoints [seqs, W] (int64; W may be 0): for speculative decoding's verification
// queries, the slot that receives the state after each of the sequence's first W tokens
// (-1: none), so a partial acceptance resumes from the last kept token.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "vec_math.h"
#include "kernels.h"

namespace {

constexpr int64_t kMaxValueDim = 256;  // dv of the generic path (the sizes of released models are fixed)

// One (sequence, value head) over tokens [t0, t1). DV > 0: the value head size known at
// compile time (64, 128): the rows of S are then a few vector registers, kS and o stay in
// registers across a pass, and no loop pays set-up per row (with dv known only at run
// time, the per-row set-up of two 4-vector loops cost more than their arithmetic).
template <typename scalar_t, int64_t DV>
void delta_rule_head(const scalar_t* q, const scalar_t* k, const scalar_t* v, const float* g, const float* beta,
                     scalar_t* out, float* S, int64_t t0, int64_t t1, int64_t key_head, int64_t head,
                     int64_t key_heads, int64_t heads, int64_t dk, int64_t dv_runtime, std::vector<float>& buf) {
  const int64_t dv = DV > 0 ? DV : dv_runtime;
  buf.resize(2 * dk);
  float* qn = buf.data();
  float* kn = qn + dk;
  float kS[DV > 0 ? DV : kMaxValueDim], o[DV > 0 ? DV : kMaxValueDim];
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = t0; t < t1; ++t) {
    const scalar_t* qt = q + (t * key_heads + key_head) * dk;
    const scalar_t* kt = k + (t * key_heads + key_head) * dk;
    float qq = 0.f, kk = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      qn[i] = static_cast<float>(qt[i]);
      kn[i] = static_cast<float>(kt[i]);
      qq += qn[i] * qn[i];
      kk += kn[i] * kn[i];
    }
    const float qf = q_scale / std::sqrt(qq + 1e-6f), kf = 1.f / std::sqrt(kk + 1e-6f);
    for (int64_t i = 0; i < dk; ++i) {
      qn[i] *= qf;
      kn[i] *= kf;
    }
    const float decay = std::exp(g[t * heads + head]);
    const float b = beta[t * heads + head];
    // pass 1: what the decayed state remembers for this key (the decayed rows are not
    // stored here: pass 2 decays them again, the same product, and stores them once)
    for (int64_t j = 0; j < dv; ++j) kS[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * dv;
      const float ki = kn[i];
      for (int64_t j = 0; j < dv; ++j) kS[j] += ki * (row[j] * decay);
    }
    const scalar_t* vt = v + (t * heads + head) * dv;
    for (int64_t j = 0; j < dv; ++j) kS[j] = (static_cast<float>(vt[j]) - kS[j]) * b;  // the delta
    // pass 2: decay the state and write the delta, and read the output
    for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      const float ki = kn[i], qi = qn[i];
      for (int64_t j = 0; j < dv; ++j) {
        const float r = row[j] * decay + ki * kS[j];
        row[j] = r;
        o[j] += qi * r;
      }
    }
    scalar_t* ot = out + (t * heads + head) * dv;
    for (int64_t j = 0; j < dv; ++j) ot[j] = static_cast<scalar_t>(o[j]);
  }
}

template <typename scalar_t>
using DeltaRuleHead = void (*)(const scalar_t*, const scalar_t*, const scalar_t*, const float*, const float*,
                               scalar_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, std::vector<float>&);

template <typename scalar_t>
DeltaRuleHead<scalar_t> delta_rule_for(int64_t dv) {
  if (dv == 64) return &delta_rule_head<scalar_t, 64>;
  if (dv == 128) return &delta_rule_head<scalar_t, 128>;
  return &delta_rule_head<scalar_t, 0>;
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& state, const at::Tensor& query_start,
                            const at::Tensor& slots, const at::Tensor& has_state, const at::Tensor& checkpoints) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0), "bad shapes");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous(), "the state must be contiguous fp32");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, "g and beta must be fp32");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v: one dtype");
  const int64_t key_heads = q.size(1), dk = q.size(2), heads = v.size(1), dv = v.size(2);
  TORCH_CHECK(heads % key_heads == 0 && state.size(1) == heads && state.size(2) == dk && state.size(3) == dv,
              "the state must be [slots, value_heads, dk, dv]");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = g.contiguous(), bc = beta.contiguous();
  const at::Tensor qs = query_start.to(at::kInt).contiguous(), sl = slots.to(at::kLong).contiguous();
  const at::Tensor hs = has_state.to(at::kBool).contiguous();
  const at::Tensor ck = checkpoints.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(vc);
  const int64_t num_seqs = sl.size(0), rep = heads / key_heads, width = ck.size(1);
  TORCH_CHECK(ck.size(0) == num_seqs, "checkpoints must be [seqs, W]");
  const int64_t* ckp = ck.data_ptr<int64_t>();
  const int32_t* qsp = qs.data_ptr<int32_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const bool* hsp = hs.data_ptr<bool>();
  float* statep = state.data_ptr<float>();
  const int64_t n = num_seqs * heads;
  TORCH_CHECK(dv <= kMaxValueDim, "value heads of at most ", kMaxValueDim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "gated_delta_rule", [&] {
    const DeltaRuleHead<scalar_t> head_rule = delta_rule_for<scalar_t>(dv);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> buf;
      for (int64_t item = next.fetch_add(1); item < n; item = next.fetch_add(1)) {
        const int64_t seq = item / heads, head = item % heads;
        float* S = statep + (slp[seq] * heads + head) * dk * dv;
        if (!hsp[seq]) std::fill(S, S + dk * dv, 0.f);
        auto run = [&](int64_t t0, int64_t t1) {
          head_rule(qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), gc.data_ptr<float>(),
                    bc.data_ptr<float>(), out.data_ptr<scalar_t>(), S, t0, t1, head / rep, head, key_heads, heads, dk,
                    dv, buf);
        };
        const int64_t t0 = qsp[seq], t1 = qsp[seq + 1];
        const int64_t kept = std::min(width, t1 - t0);  // tokens whose state is checkpointed
        for (int64_t j = 0; j < kept; ++j) {
          run(t0 + j, t0 + j + 1);
          const int64_t c = ckp[seq * width + j];
          if (c >= 0) std::copy(S, S + dk * dv, statep + (c * heads + head) * dk * dv);
        }
        run(t0 + kept, t1);
      }
    });
  });
  return out;
}

constexpr int64_t kConvChannelBlock = 256;  // channels per work item (a long prompt alone still splits)

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_state,
                         const at::Tensor& query_start, const at::Tensor& slots, const at::Tensor& has_state,
                         const at::Tensor& checkpoints) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(0), "bad shapes");
  const int64_t channels = x.size(1), kernel = weight.size(1), hist = kernel - 1;
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.size(1) == channels && conv_state.size(2) == hist,
              "the conv state must be [slots, channels, kernel - 1], contiguous");
  TORCH_CHECK(x.scalar_type() == conv_state.scalar_type(), "x and the conv state: one dtype");
  // the weight tap-major ([kernel, channels]): a tap's products are one vector pass over
  // the channels
  const at::Tensor xc = x.contiguous(), wt = weight.to(at::kFloat).t().contiguous();
  const at::Tensor qs = query_start.to(at::kInt).contiguous(), sl = slots.to(at::kLong).contiguous();
  const at::Tensor hs = has_state.to(at::kBool).contiguous();
  const at::Tensor ck = checkpoints.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t num_seqs = sl.size(0), width = ck.size(1);
  TORCH_CHECK(ck.size(0) == num_seqs, "checkpoints must be [seqs, W]");
  const int64_t* ckp = ck.data_ptr<int64_t>();
  const int32_t* qsp = qs.data_ptr<int32_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const bool* hsp = hs.data_ptr<bool>();
  const float* wp = wt.data_ptr<float>();
  const int64_t blocks = (channels + kConvChannelBlock - 1) / kConvChannelBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* cs = conv_state.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * blocks, 1, [&](int64_t begin, int64_t end) {
      // a sequence's inputs before its first token, tap-major (the state is channel-major)
      std::vector<scalar_t> before(hist * kConvChannelBlock);
      float acc[kConvChannelBlock];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t seq = item / blocks, c0 = (item % blocks) * kConvChannelBlock;
        const int64_t nc = std::min(kConvChannelBlock, channels - c0);
        const int64_t t0 = qsp[seq], len = qsp[seq + 1] - t0;
        scalar_t* state = cs + slp[seq] * channels * hist;
        for (int64_t c = 0; c < nc; ++c)
          for (int64_t i = 0; i < hist; ++i)
            before[i * nc + c] = hsp[seq] ? state[(c0 + c) * hist + i] : static_cast<scalar_t>(0.f);
        // input r of the sequence (r < 0: the r-th before its first token), channels c0..
        const auto input = [&](int64_t r) -> const scalar_t* {
          return r >= 0 ? xp + (t0 + r) * channels + c0 : before.data() + (hist + r) * nc;
        };
        const auto save_window = [&](int64_t r, scalar_t* to) {  // the inputs up to r, as a state
          for (int64_t i = 0; i < hist; ++i) {
            const scalar_t* in = input(r - hist + 1 + i);
            for (int64_t c = 0; c < nc; ++c) to[(c0 + c) * hist + i] = in[c];
          }
        };
        for (int64_t r = 0; r < len; ++r) {
          for (int64_t c = 0; c < nc; ++c) acc[c] = 0.f;
          for (int64_t i = 0; i <= hist; ++i) {
            const scalar_t* in = input(r - hist + i);
            const float* w = wp + i * channels + c0;
            for (int64_t c = 0; c < nc; ++c) acc[c] += w[c] * static_cast<float>(in[c]);
          }
          scalar_t* ot = op + (t0 + r) * channels + c0;
          for (int64_t c = 0; c < nc; ++c) ot[c] = static_cast<scalar_t>(vlmserve::silu(acc[c]));
          if (r < width && ckp[seq * width + r] >= 0) save_window(r, cs + ckp[seq * width + r] * channels * hist);
        }
        save_window(len - 1, state);  // after `before` was read: the slot's own state is overwritten last
      }
    });
  });
  return out;
}

}  // namespace

VLMSERVE_EXPORT(gated_delta_rule);
VLMSERVE_EXPORT(causal_conv1d);
