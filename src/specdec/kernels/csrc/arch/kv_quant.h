// The vector forms of reading Q8_0 cache rows (ops/kv_quant.h): a block's 32 values q * d, 16 (AVX-512) or 8
// (AVX2) at a time, in fp32 (the same products as the portable loop's) or, where the build has AVX-512 BF16,
// rounded to bf16 by VCVTNEPS2BF16 (to nearest even: the portable rounding's bits).
#pragma once
#include "../isa/vec.h"

namespace SPECDEC_QLIB {
namespace {

// out[i] = float(q[i]) * d for the first i of a block of n (a multiple of 16); returns the values done.
inline int64_t q8_block_f32_vec(const int8_t* q, float d, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < n; i += 16) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(d)));
  }
#elif defined(__AVX2__)
  for (; i < n; i += 8) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(d)));
  }
#endif
  return i;
}

// out[i] = bf16(float(q[i]) * d), to nearest even, for a block of n (a multiple of 16); returns the values done
// (0 where the build has no bf16 conversion: the caller rounds the fp32 values itself).
inline int64_t q8_block_bf16_vec(const int8_t* q, float d, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i < n; i += 16) {  // (VCVTNEPS2BF16: to nearest even)
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(d)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(h));
  }
#endif
  return i;
}

}  // namespace
}  // namespace SPECDEC_QLIB
