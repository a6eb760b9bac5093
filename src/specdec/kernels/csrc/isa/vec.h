#pragma once
#include "../common.h"

// ---- 32-byte vectors: 32 x u8/i8, 16 x i16, 8 x i32 or 8 x f32 -------------------------------------
// Each operation is defined lane by lane (the scalar code says what), so that the AVX2 and portable
// builds compute the same values.
#if defined(__AVX2__)
#include "avx2.h"
#else
#include "generic.h"
#endif

namespace SPECDEC_QLIB {
namespace {


// The sum of the 8 int32 lanes (exact: the order does not matter).
inline int32_t hsum_i(VI v) {
#if defined(__AVX2__)
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
#else
  int32_t t = 0;
  for (int i = 0; i < 8; ++i) t += v.w[i];
  return t;
#endif
}

}  // namespace
}  // namespace SPECDEC_QLIB
