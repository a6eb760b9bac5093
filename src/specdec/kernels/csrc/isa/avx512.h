#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "avx2.h"

// The same kernels on 512-bit vectors: one zmm holds what the 256-bit code keeps in its two chains
// (lanes 0-7: acc / even blocks, lanes 8-15: acc2 / odd blocks), so every integer lane, and every fp32
// lane after the halves are added, is the value the 256-bit code computes: the same bits, half the
// instructions per row.
#define SPECDEC_Z512 1

namespace SPECDEC_QLIB {
namespace {

inline __m512i bcast256(VI v) { return _mm512_broadcast_i64x4(v); }
inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// acc + madd(p, s): fused (VNNI) when rows are many enough to hide its latency, else madd + add (one
// cycle on the loop-carried chain of a single row); the same integers either way.
template <int R>
inline __m512i madd_acc_z(__m512i acc, __m512i p, __m512i s) {
  if (R > 2) return _mm512_dpwssd_epi32(acc, p, s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
}
inline __m512i shifts(int lo, int hi) {  // i16 shift counts: lo for bytes 0-31, hi for bytes 32-63
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)), _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

// The exact sums of the lanes of two items at once: a0, a1 (16 int32 lanes each), m0, m1 (8 each) -> out4 =
// {sum a0, sum a1, sum m0, sum m1}.
inline void sums2(__m512i a0, __m512i a1, VI m0, VI m1, int32_t* out4) {
  const __m512i u = _mm512_add_epi32(_mm512_shuffle_i64x2(a0, a1, 0x44), _mm512_shuffle_i64x2(a0, a1, 0xEE));
  const __m512i m = _mm512_inserti64x4(_mm512_castsi256_si512(m0), m1, 1);
  __m512i v = _mm512_add_epi32(_mm512_shuffle_i64x2(u, m, 0x88), _mm512_shuffle_i64x2(u, m, 0xDD));
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0x4E)));
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0xB1)));
  alignas(64) int32_t t[16];
  _mm512_store_si512(t, v);
  out4[0] = t[0];
  out4[1] = t[4];
  out4[2] = t[8];
  out4[3] = t[12];
}

// Lane r of the result: the exact sum of the 16 lanes of v[r], r < R <= 8 (a transposing tree: 24 operations
// for 8 vectors).
template <int R>
inline VI reduce8(const __m512i* in) {
  __m512i v[8], t[4], u[2];
  for (int k = 0; k < 8; ++k) v[k] = k < R ? in[k] : _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p)  // 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_epi32(v[2 * p], v[2 * p + 1]));
  for (int q = 0; q < 2; ++q)  // 128-bit lane: the sums of vectors 4q..4q + 3 over that lane
    u[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * q], t[2 * q + 1]), _mm512_unpackhi_epi64(t[2 * q], t[2 * q + 1]));
  const __m512i x = _mm512_add_epi32(_mm512_shuffle_i64x2(u[0], u[1], 0x88), _mm512_shuffle_i64x2(u[0], u[1], 0xDD));
  const __m512i y = _mm512_add_epi32(x, _mm512_shuffle_i64x2(x, x, 0xB1));  // [u0, u0, u1, u1] summed over lanes
  return _mm512_castsi512_si256(_mm512_shuffle_i64x2(y, y, 0x08));
}

}  // namespace
}  // namespace SPECDEC_QLIB
#endif
