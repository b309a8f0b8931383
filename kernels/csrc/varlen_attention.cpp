// Bidirectional attention within packed sequences (the vision towers' windows and
// frames), bf16 on CPUs with AVX512-BF16.
//
// torch's CPU flash attention runs these shapes (16 heads of 64-80 channels, sequences of
// 64 to several thousand patches) at ~190 GFLOP/s in bf16, as in fp32: a quarter of what
// this CPU's bf16 dot product gives a matmul. Here both products run on that instruction.
//
// q, k, v: [tokens, heads, D] bf16 (rows may be strided: views of one qkv projection),
// the sequences back to back; cu_seqlens [seqs + 1] int64. Work items are (sequence, head,
// a share of its queries), handed to the threads from a shared counter. An item packs its
// sequence's keys for that head as pairs of channels, kp[p][j] = (k[j][2p], k[j][2p + 1]),
// and the values as pairs of tokens, vp[jj][c] = (v[2jj][c], v[2jj + 1][c]) (the operands
// of the dot product, as in the paged KV cache), into its thread's scratch, then walks its
// queries kBlockQ at a time and the keys kBlockK at a time with an online softmax (scores
// and output in fp32, probabilities rounded to bf16 for the second product, as flash
// attention does), kRows query rows at a time with their accumulators in registers.
//
// Packing into each thread's scratch, not every head of every sequence into one buffer
// first: for a tower's windows of 64 patches that buffer was 4 KB a token (106 MB for
// four pictures' 20,736 patches), zeroed by one thread and faulted in page by page on
// every call (131 ms a call, 91 ms of it in the kernel's page faults); now such a call
// takes 79 ms, and full attention over a picture's 5,184 patches runs as before (0.28
// TFLOP/s; AMD EPYC Zen 4, 2 threads, the same outputs).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "vec_math.h"
#include "kernels.h"

namespace {

#if defined(__AVX512BF16__)

constexpr int64_t kBlockQ = 64;   // query rows per work item
constexpr int64_t kBlockK = 128;  // keys per online-softmax step
constexpr int kRows = 4;          // query rows computed together
constexpr int kMaxCols = 5;       // 16-lane accumulators per row at most (registers)
constexpr float kNoScore = -1e30f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// s[r][16 c + i] = q[r] . k[j0 + 16 c + i] for kRows rows and NC groups of 16 keys.
template <int NC>
inline void score_tile(const uint32_t* q_pairs, int64_t half_d, const uint32_t* kp, int64_t lp, float* s,
                       int64_t s_stride) {
  __m512 acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half_d; ++p) {
    __m512bh keys[NC];
    for (int c = 0; c < NC; ++c) keys[c] = (__m512bh)_mm512_loadu_si512(kp + p * lp + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[r * half_d + p]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], keys[c], qr);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(s + r * s_stride + 16 * c, acc[r][c]);
}

// o[r][16 c + i] += sum over jj of p[r][2jj] v[2jj][.] + p[r][2jj + 1] v[2jj + 1][.], for NC
// groups of 16 output channels; vp points at the block's first pair of tokens.
template <int NC>
inline void value_tile(const uint32_t* p_pairs, int64_t pairs, const uint32_t* vp, int64_t dp, float* o,
                       int64_t o_stride) {
  __m512 acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(o + r * o_stride + 16 * c);
  for (int64_t jj = 0; jj < pairs; ++jj) {
    __m512bh values[NC];
    for (int c = 0; c < NC; ++c) values[c] = (__m512bh)_mm512_loadu_si512(vp + jj * dp + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[r * (kBlockK / 2) + jj]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], values[c], pr);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * o_stride + 16 * c, acc[r][c]);
}

struct Layout {
  int64_t heads, dim, half_d, dp;  // dp: channels rounded up to 16
  int64_t q_stride, k_stride, v_stride;  // elements between tokens
};

// A thread's working memory, for sequences of up to max_lp tokens (rounded up to 16). The
// packed keys and values are one allocation: as two, each page-aligned, full attention over
// 5,184 patches ran at 0.21-0.23 TFLOP/s where it runs at 0.28 (measured; the two streams'
// lines falling in the same cache sets is the likely cause).
struct Scratch {
  std::vector<uint32_t> q_pairs, p_pairs, packed;
  std::vector<float> scores, o, row_max, row_sum;
  uint32_t *kp, *vp;  // within packed
  Scratch(const Layout& l, int64_t max_lp)
      : q_pairs(kBlockQ * l.half_d), p_pairs(kRows * kBlockK / 2), packed(l.half_d * max_lp + max_lp / 2 * l.dp),
        scores(kRows * kBlockK), o(kBlockQ * l.dp), row_max(kBlockQ), row_sum(kBlockQ), kp(packed.data()),
        vp(packed.data() + l.half_d * max_lp) {}
};

// Packs one (sequence, head)'s keys and values; zeros past the sequence and the channels.
void pack(const uint16_t* k, const uint16_t* v, const Layout& l, int64_t begin, int64_t len, int64_t h, uint32_t* kp,
          uint32_t* vp) {
  const int64_t lp = round_up(len, 16);
  std::memset(vp + (len + 1) / 2 * l.dp, 0, (lp / 2 - (len + 1) / 2) * l.dp * sizeof(uint32_t));
  // keys: 16 tokens' pair p gathered into one vector (zeros past the sequence)
  const __m512i token_words = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32(static_cast<int>(l.k_stride / 2)));
  for (int64_t j = 0; j < lp; j += 16) {
    const __mmask16 tokens = static_cast<__mmask16>((1u << std::min<int64_t>(16, std::max<int64_t>(0, len - j))) - 1);
    const uint16_t* first = k + (begin + j) * l.k_stride + h * l.dim;
    for (int64_t p = 0; p < l.half_d; ++p)
      _mm512_storeu_si512(kp + p * lp + j, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tokens, token_words,
                                                                       first + 2 * p, 4));
  }
  for (int64_t j = 0; j < len; j += 2) {  // two tokens' channels interleaved, 16 channels at a time
    const uint16_t* even = v + (begin + j) * l.v_stride + h * l.dim;
    const uint16_t* odd = j + 1 < len ? even + l.v_stride : nullptr;
    for (int64_t c = 0; c < l.dim; c += 16) {
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, l.dim - c)) - 1);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even + c));
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, odd + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (j / 2) * l.dp + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Queries [q0, q1) of a sequence of len tokens starting at begin, one head. Not inlined:
// inlined into the loop over a work item's query blocks, GCC's code ran full attention
// 5-10% slower (heads of 72 over 4,096 patches: 0.24 against 0.27 TFLOP/s; measured).
__attribute__((noinline)) void attend(const uint16_t* q, uint16_t* out, const Layout& l, int64_t begin, int64_t len,
                                      int64_t h, int64_t q0, int64_t q1, const uint32_t* kp, const uint32_t* vp,
                                      float scale, Scratch& w) {
  const int64_t rows = q1 - q0, lp = round_up(len, 16);
  std::fill(w.q_pairs.begin(), w.q_pairs.end(), 0u);
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(&w.q_pairs[i * l.half_d], q + (begin + q0 + i) * l.q_stride + h * l.dim, l.dim * sizeof(uint16_t));
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.row_max.begin(), w.row_max.end(), kNoScore);
  std::fill(w.row_sum.begin(), w.row_sum.end(), 0.f);
  const int64_t out_groups = l.dp / 16;
  for (int64_t j0 = 0; j0 < len; j0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, lp - j0);  // a multiple of 16
    const int64_t valid = std::min(kBlockK, len - j0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      for (int64_t c0 = 0; c0 < cols; c0 += 64)
        vlmserve::with_constant<4>(static_cast<int>((cols - c0) / 16), [&](auto nc) {
          score_tile<decltype(nc)::value>(&w.q_pairs[r0 * l.half_d], l.half_d, kp + j0 + c0, lp, &w.scores[c0],
                                          kBlockK);
        });
      for (int r = 0; r < kRows && r0 + r < rows; ++r) {
        float* s = &w.scores[r * kBlockK];
        for (int64_t j = valid; j < cols; ++j) s[j] = kNoScore;
        // scale and running maximum by hand: GCC keeps a float max reduction scalar
        __m512 top16 = _mm512_set1_ps(w.row_max[r0 + r]);
        for (int64_t j = 0; j < cols; j += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(scale));
          _mm512_storeu_ps(s + j, x);
          top16 = _mm512_max_ps(top16, x);
        }
        const float top = _mm512_reduce_max_ps(top16);
        const float alpha = vlmserve::exp_approx(w.row_max[r0 + r] - top);
        float sum = 0.f;
        for (int64_t j = 0; j < cols; ++j) {
          s[j] = vlmserve::exp_approx(s[j] - top);
          sum += s[j];
        }
        w.row_sum[r0 + r] = w.row_sum[r0 + r] * alpha + sum;
        w.row_max[r0 + r] = top;
        float* o = &w.o[(r0 + r) * l.dp];
        for (int64_t c = 0; c < l.dp; ++c) o[c] *= alpha;
        uint32_t* pr = &w.p_pairs[r * (kBlockK / 2)];
        for (int64_t j = 0; j < cols; j += 32)
          _mm512_storeu_si512(pr + j / 2,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j)));
      }
      const uint32_t* vblock = vp + (j0 / 2) * l.dp;
      for (int64_t g0 = 0; g0 < out_groups; g0 += kMaxCols)
        vlmserve::with_constant<kMaxCols>(static_cast<int>(out_groups - g0), [&](auto nc) {
          value_tile<decltype(nc)::value>(w.p_pairs.data(), cols / 2, vblock + 16 * g0, l.dp, &w.o[r0 * l.dp + 16 * g0],
                                          l.dp);
        });
    }
  }
  // o / sum, rounded to bf16 16 channels at a time: by hand, since round_row.h's loop here
  // made GCC's code for this function 10-20% slower on full attention (measured)
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / w.row_sum[i]);
    uint16_t* dst = out + (begin + q0 + i) * l.heads * l.dim + h * l.dim;
    for (int64_t c = 0; c < l.dim; c += 16) {
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, l.dim - c)) - 1);
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&w.o[i * l.dp + c]), inv));
      _mm256_mask_storeu_epi16(dst + c, lanes, (__m256i)rounded);
    }
  }
}

#endif

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, double scale) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v must be [tokens, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "varlen_attention: bf16 only");
  TORCH_CHECK(q.size(2) % 2 == 0, "the head size must be even");
  const int64_t heads = q.size(1), dim = q.size(2);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim, "each token's heads must be contiguous");
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t seqs = cu.numel() - 1;
  const int64_t* starts = cu.data_ptr<int64_t>();
  TORCH_CHECK(seqs >= 1 && starts[0] == 0 && starts[seqs] == q.size(0), "cu_seqlens must cover the tokens");
  const Layout l{heads, dim, dim / 2, round_up(dim, 16), q.stride(0), k.stride(0), v.stride(0)};
  at::Tensor out = at::empty({q.size(0), heads, dim}, q.options());

  // the work items: each (sequence, head) in as many shares of its query blocks as keep
  // every thread busy (one share, and one packing, when the sequences' heads are enough)
  struct Item {
    int64_t seq, head, q0, q1;
  };
  const int64_t threads = at::get_num_threads();
  const int64_t shares = std::max<int64_t>(1, (4 * threads + seqs * heads - 1) / (seqs * heads));
  std::vector<Item> items;
  int64_t max_lp = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    TORCH_CHECK(len > 0, "empty sequence");
    max_lp = std::max(max_lp, round_up(len, 16));
    const int64_t blocks = (len + kBlockQ - 1) / kBlockQ, parts = std::min(shares, blocks);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < parts; ++i)
        items.push_back({s, h, blocks * i / parts * kBlockQ, std::min(len, blocks * (i + 1) / parts * kBlockQ)});
  }
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w(l, max_lp);
    for (int64_t i = next++; i < total; i = next++) {
      const Item& it = items[i];
      const int64_t len = starts[it.seq + 1] - starts[it.seq];
      pack(kd, vd, l, starts[it.seq], len, it.head, w.kp, w.vp);
      for (int64_t q0 = it.q0; q0 < it.q1; q0 += kBlockQ)
        attend(qd, od, l, starts[it.seq], len, it.head, q0, std::min(it.q1, q0 + kBlockQ), w.kp, w.vp,
               static_cast<float>(scale), w);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "varlen_attention needs AVX512-BF16");
#endif
}

}  // namespace

VLMSERVE_EXPORT(varlen_attention);
