// fp32 vectors for the kernels that compute in fp32 lane by lane (attention: arch/attention.h, amx/attention.h):
// F8 (8 lanes, AVX2) and F16 (16 lanes, AVX-512F) with one interface, and the exp and the sums whose portable
// forms (`exp_one`, `reduce8f`) define the bits: every vector form does the same operations, lane by lane,
// multiplies and adds never fused (the builds' -ffp-contract=off), so every build gives the same values.
#pragma once
#include "../common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace SPECDEC_QLIB {
namespace {

// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)): the sum of 8 lanes in the order every build adds them
inline float reduce8f(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

// exp(x) for x <= 0 (scores less their maximum): Cephes' expf (2^n times a degree-6 polynomial on
// [-ln2/2, ln2/2], within 2 ulp), in basic operations only, so that every build computes the same bits
// (std::exp is a library call, scalar); `exp_vec` does the same operations, F::kLanes at a time.
inline float exp_one(float x) {
  const float v = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: still a normal float
  const float r = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(v / ln2)
  float f = v - r * 0.693359375f;  // v - r * ln2, ln2 in two parts
  f = f - r * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = (p * (f * f) + f) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(r) + 127) << 23;  // 2^r
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__)
// 8 lanes (AVX2) or, on the 512-bit builds, 16; every operation lane by lane, multiplies and adds never fused.
struct F8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V at_least(V x, V c) { return _mm256_blendv_ps(x, c, _mm256_cmp_ps(x, c, _CMP_LT_OQ)); }  // x < c ? c : x
  static V pow2(V r) {  // 2^r for whole r in the normal range
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(r), _mm256_set1_epi32(127)), 23));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif
#if defined(__AVX512F__)
struct F16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V at_least(V x, V c) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c, _CMP_LT_OQ), x, c); }
  static V pow2(V r) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(r), _mm512_set1_epi32(127)), 23));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

#if defined(__AVX2__)
// `exp_one` on the F::kLanes lanes of a vector.
template <typename F>
inline typename F::V exp_vec(typename F::V x) {
  using V = typename F::V;
  const auto c = F::set1;
  const V v = F::at_least(x, c(-87.0f));
  const V r = F::sub(F::add(F::mul(v, c(1.44269504088896341f)), c(12582912.0f)), c(12582912.0f));
  V f = F::sub(v, F::mul(r, c(0.693359375f)));
  f = F::sub(f, F::mul(r, c(-2.12194440e-4f)));
  V p = c(1.9875691500e-4f);
  p = F::add(F::mul(p, f), c(1.3981999507e-3f));
  p = F::add(F::mul(p, f), c(8.3334519073e-3f));
  p = F::add(F::mul(p, f), c(4.1665795894e-2f));
  p = F::add(F::mul(p, f), c(1.6666665459e-1f));
  p = F::add(F::mul(p, f), c(5.0000001201e-1f));
  p = F::add(F::add(F::mul(p, F::mul(f, f)), f), c(1.0f));
  return F::mul(p, F::pow2(r));
}

// `exp_one` on x[i ..], F::kLanes at a time, as far as whole vectors go; returns where it stopped.
template <typename F>
inline int64_t exp_vectors(float* x, int64_t i, int64_t n) {
  for (; i + F::kLanes <= n; i += F::kLanes) F::store(x + i, exp_vec<F>(F::load(x + i)));
  return i;
}

// The lane sums ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) of four accumulators, as `reduce8f` adds them.
inline __m128 reduce4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h01 = _mm256_hadd_ps(a0, a1);  // [a0 l0+l1, a0 l2+l3, a1 .., a1 .. | a0 l4+l5, a0 l6+l7, a1 .., a1 ..]
  const __m256 h23 = _mm256_hadd_ps(a2, a3);
  const __m256 h = _mm256_hadd_ps(h01, h23);  // [a0..a3 (l0+l1)+(l2+l3) | a0..a3 (l4+l5)+(l6+l7)]
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// exp_one(x[i]) for i in [0, n), in place: whole vectors of the widest fp32 vectors first, then of 8, then one
// by one (the same bits whichever computes an element).
inline void exp_nonpositive(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  i = exp_vectors<F16>(x, i, n);
#endif
#if defined(__AVX2__)
  i = exp_vectors<F8>(x, i, n);
#endif
  for (; i < n; ++i) x[i] = exp_one(x[i]);
}

}  // namespace
}  // namespace SPECDEC_QLIB
