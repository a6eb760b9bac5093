// The vector forms of the activations' quantization (acts.h): `quantize_block` and the bf16 -> fp32 widening on
// the AVX-512 and AVX2 builds. Elementwise IEEE operations and an order-free maximum, so each gives the bytes of
// acts.h's scalar form (`quantize_block_scalar`), special values included.
#pragma once
#include "../isa/vec.h"

namespace SPECDEC_QLIB {
namespace {

// One row's block: its quants q, the sums of every 16 and the scale d, as `quantize_block_scalar` computes
// them; false where the build has no vector form (the caller runs the scalar one).
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline bool quantize_block_vec(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < bs; i += 16) mx = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), mx);  // NaN: mx
  const float amax = _mm512_reduce_max_ps(mx);
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  *d = amax / 127.f;
  const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t g = 0; g < bs / 16; ++g) {
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * g), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // NaN: -127, as the scalar form
    const __m512i w = _mm512_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g), _mm512_cvtepi32_epi8(w));
    s[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(w));
  }
  return true;
}
#elif defined(__AVX2__)
inline bool quantize_block_vec(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < bs; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), mx);  // NaN: mx
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  *d = amax / 127.f;
  const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t g = 0; g < bs / 16; ++g) {
    __m256i w[2];
    for (int k = 0; k < 2; ++k) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8 * k), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);  // NaN: -127, as the scalar form
      w[k] = _mm256_cvtps_epi32(v);
    }
    // 16 int32 in [-127, 127] -> 16 bytes, in order (the packs work within 128-bit lanes: fix the order after)
    const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[0], w[1]), 0xD8);
    const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g), p8);
    __m256i t = _mm256_add_epi32(w[0], w[1]);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    s[g] = static_cast<int16_t>(_mm_cvtsi128_si32(t4));
  }
  return true;
}
#else
inline bool quantize_block_vec(const float*, int64_t, int8_t*, int16_t*, float*) { return false; }
#endif

// y[k] = float(x[k]) (bf16's bits as the top 16), 16 (AVX-512) or 8 (AVX2) at a time as far as whole vectors go;
// returns where it stopped.
inline int64_t bf16_to_f32_vec(const at::BFloat16* x, int64_t n, float* y) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= n; k += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
    _mm512_storeu_ps(y + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#elif defined(__AVX2__)
  for (; k + 8 <= n; k += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k)));
    _mm256_storeu_ps(y + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  return k;
}

}  // namespace
}  // namespace SPECDEC_QLIB
