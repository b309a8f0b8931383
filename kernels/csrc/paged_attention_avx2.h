// paged_attention.cpp's block products and softmax in AVX2 + FMA intrinsics, for CPUs
// without AVX512-BF16 (and fp32 caches on any x86 CPU): bf16 or fp32 caches, blocks of
// 16 tokens, head sizes a multiple of 16. The plain C++ they replace ran at 40-50 GFLOP/s
// on 2 Zen 3 cores, the exp of the softmax one lane at a time.
//
// Both caches hold pairs (keys: two channels of a token; values: two tokens of a
// channel). A bf16 pair widens to fp32 already split: the low half of each 32-bit lane
// shifted up is the first value, the high half masked the second. fp32 pairs are
// multiplied against a broadcast pair of the other operand and the pair's two products
// summed at the end (hadd, then the 64-bit lanes put back in order).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace vlmserve::avx2_attention {

constexpr int kBlock = 16;  // tokens per cache block these take

// e^x for 8 lanes: vec_math.h's exp_approx, in intrinsics (0 below -87)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256 scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ), _mm256_mul_ps(p, scale));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 bf16 pairs (a 32-bit lane each): the first of each pair, and the second, in fp32
inline __m256 first_of_pairs(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 second_of_pairs(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __m256i load8(const c10::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// the two products of each of 4 pairs in a and in b summed: 8 lanes, a's 4 then b's 4
inline __m256 sum_pairs(__m256 a, __m256 b) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a, b)), 0xD8));
}

inline __m256 broadcast_pair(const float* p) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
}

// scores[r][t] = q[r] . key[t] for R rows (fp32 queries, stride D, already scaled) and
// one block of keys [D / 2, 16, 2]
template <int R, int D>
inline void block_scores(const float* q, const c10::BFloat16* keys, float* scores) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int dp = 0; dp < D / 2; ++dp) {
    const __m256i lo = load8(keys + dp * 2 * kBlock), hi = load8(keys + dp * 2 * kBlock + kBlock);
    const __m256 even_lo = first_of_pairs(lo), odd_lo = second_of_pairs(lo);
    const __m256 even_hi = first_of_pairs(hi), odd_hi = second_of_pairs(hi);
    for (int r = 0; r < R; ++r) {
      const __m256 q0 = _mm256_broadcast_ss(q + r * D + 2 * dp), q1 = _mm256_broadcast_ss(q + r * D + 2 * dp + 1);
      acc[r][0] = _mm256_fmadd_ps(odd_lo, q1, _mm256_fmadd_ps(even_lo, q0, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(odd_hi, q1, _mm256_fmadd_ps(even_hi, q0, acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(scores + r * kBlock, acc[r][0]);
    _mm256_storeu_ps(scores + r * kBlock + 8, acc[r][1]);
  }
}

template <int R, int D>
inline void block_scores(const float* q, const float* keys, float* scores) {
  for (int half = 0; half < 2; ++half) {  // tokens 0-7, then 8-15
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int dp = 0; dp < D / 2; ++dp) {
      const float* k = keys + dp * 2 * kBlock + half * kBlock;
      const __m256 a = _mm256_loadu_ps(k), b = _mm256_loadu_ps(k + 8);  // tokens 0-3, 4-7 of the half
      for (int r = 0; r < R; ++r) {
        const __m256 qq = broadcast_pair(q + r * D + 2 * dp);
        acc[r][0] = _mm256_fmadd_ps(a, qq, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(b, qq, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(scores + r * kBlock + half * 8, sum_pairs(acc[r][0], acc[r][1]));
  }
}

// out[r] = out[r] * correction[r] + sum_t p[r][t] * value[t] for R rows (p: stride 16,
// out: stride D) and one block of values [8, D, 2]
template <int R, int D>
inline void block_values(const float* p, const float* correction, const c10::BFloat16* values, float* out) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(out + r * D + d0 + 8 * c), _mm256_set1_ps(correction[r]));
    for (int tp = 0; tp < kBlock / 2; ++tp) {
      const __m256i lo = load8(values + (tp * D + d0) * 2), hi = load8(values + (tp * D + d0 + 8) * 2);
      const __m256 first_lo = first_of_pairs(lo), second_lo = second_of_pairs(lo);
      const __m256 first_hi = first_of_pairs(hi), second_hi = second_of_pairs(hi);
      for (int r = 0; r < R; ++r) {
        const __m256 p0 = _mm256_broadcast_ss(p + r * kBlock + 2 * tp), p1 = _mm256_broadcast_ss(p + r * kBlock + 2 * tp + 1);
        acc[r][0] = _mm256_fmadd_ps(second_lo, p1, _mm256_fmadd_ps(first_lo, p0, acc[r][0]));
        acc[r][1] = _mm256_fmadd_ps(second_hi, p1, _mm256_fmadd_ps(first_hi, p0, acc[r][1]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(out + r * D + d0 + 8 * c, acc[r][c]);
  }
}

template <int R, int D>
inline void block_values(const float* p, const float* correction, const float* values, float* out) {
  for (int d0 = 0; d0 < D; d0 += 8) {
    __m256 acc[R][2];  // pairs: channels d0..d0+3, d0+4..d0+7
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int tp = 0; tp < kBlock / 2; ++tp) {
      const __m256 a = _mm256_loadu_ps(values + (tp * D + d0) * 2), b = _mm256_loadu_ps(values + (tp * D + d0 + 4) * 2);
      for (int r = 0; r < R; ++r) {
        const __m256 pp = broadcast_pair(p + r * kBlock + 2 * tp);
        acc[r][0] = _mm256_fmadd_ps(a, pp, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(b, pp, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = out + r * D + d0;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(correction[r]), sum_pairs(acc[r][0], acc[r][1])));
    }
  }
}

// One row's online softmax over a block: row[t] becomes exp(row[t] - max) where key t is
// visible (t0 <= t <= t1), 0 elsewhere; max moves on to the visible keys' if larger.
// Returns the sum of the new row.
inline float block_softmax_row(float* row, int64_t t0, int64_t t1, float& max) {
  const __m256i first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
  const __m256i from = _mm256_set1_epi32(static_cast<int>(t0) - 1), to = _mm256_set1_epi32(static_cast<int>(t1) + 1);
  const __m256 visible_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(first, from), _mm256_cmpgt_epi32(to, first)));
  const __m256 visible_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(second, from), _mm256_cmpgt_epi32(to, second)));
  __m256 lo = _mm256_loadu_ps(row), hi = _mm256_loadu_ps(row + 8);
  if (t0 <= t1) {
    const __m256 none = _mm256_set1_ps(-3.4e38f);
    max = std::max(max, max8(_mm256_max_ps(_mm256_blendv_ps(none, lo, visible_lo), _mm256_blendv_ps(none, hi, visible_hi))));
  }
  const __m256 m = _mm256_set1_ps(max), zero = _mm256_setzero_ps();
  lo = _mm256_and_ps(visible_lo, exp8(_mm256_min_ps(_mm256_sub_ps(lo, m), zero)));
  hi = _mm256_and_ps(visible_hi, exp8(_mm256_min_ps(_mm256_sub_ps(hi, m), zero)));
  _mm256_storeu_ps(row, lo);
  _mm256_storeu_ps(row + 8, hi);
  return sum8(_mm256_add_ps(lo, hi));
}

}  // namespace vlmserve::avx2_attention
