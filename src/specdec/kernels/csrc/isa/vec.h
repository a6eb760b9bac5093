// The vector layer, the one include of the kernels' instruction-set code: the 32-byte vectors (32 x u8/i8,
// 16 x i16, 8 x i32 or 8 x f32: avx2.h, or generic.h where the build has no AVX2; each operation defined lane by
// lane, the scalar code saying what, so that the AVX2 and portable builds compute the same values), the 512-bit
// helpers (avx512.h), the fp32 vectors (f32.h), and what else depends on the instruction set (the row groups,
// fp16). Code outside isa/ tests no compiler ISA macro (only arch/, the per-architecture forms of the ops'
// kernels, and amx/, the AMX kernel set, do): it reads what the layer says, SPECDEC_AVX2 (the 32-byte vectors
// are AVX2's), SPECDEC_Z512 (the 512-bit helpers are there) and kMaxRows.
#pragma once
#include "../common.h"

#if defined(__AVX2__)
#include "avx2.h"
#else
#include "generic.h"
#endif
#include "avx512.h"
#include "f32.h"

namespace SPECDEC_QLIB {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kMaxRows = 12;  // 32 vector registers: the k-quants' fixed lanes keep one a row (two trees: 8 and
                               // the rest); the 32-value types run a group of more than 8 rows as two
#else
constexpr int kMaxRows = 4;
#endif

// The rows of a call go in groups of at most kMaxRows, as even as can be (16 rows: 8 + 8, not 12 + 4; 9:
// 9): a group shares each weight block, and a large group's rows cost more each (registers run short).
inline int64_t row_groups(int64_t M) { return (M + kMaxRows - 1) / kMaxRows; }
inline int64_t group_start(int64_t M, int64_t g) {  // the first `M % groups` groups take one row more
  const int64_t G = row_groups(M);
  return g * (M / G) + std::min(g, M % G);
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

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
