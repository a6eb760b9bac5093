// AVX2 + FMA form of the 32-byte vectors (isa/vec.h): one instruction an operation.
#pragma once
#include "../common.h"

#include <immintrin.h>

#define SPECDEC_AVX2 1  // the 32-byte vectors are these: kernels written on them may use AVX2's own intrinsics

namespace SPECDEC_QLIB {
namespace {

using VI = __m256i;
using VF = __m256;
inline VI load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const VI*>(p)); }
inline VI zero() { return _mm256_setzero_si256(); }
inline VI set8(int8_t v) { return _mm256_set1_epi8(v); }
inline VI set16(int16_t v) { return _mm256_set1_epi16(v); }
inline VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
// byte-wise (b >> s) & mask, for masks that fit in 8 - s bits (so no bit crosses from the next byte)
inline VI shr_mask(VI b, int s, int8_t mask) { return _mm256_and_si256(_mm256_srli_epi16(b, s), set8(mask)); }
// byte-wise b << 4, for bytes below 16
inline VI shl4(VI b) { return _mm256_slli_epi16(b, 4); }
inline VI sub8(VI a, VI b) { return _mm256_sub_epi8(a, b); }
inline VI abs8(VI a) { return _mm256_abs_epi8(a); }
inline VI sign8(VI a, VI b) { return _mm256_sign_epi8(a, b); }
inline VI sub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VF fadd(VF a, VF b) { return _mm256_add_ps(a, b); }
// float(v) * s
inline VF fmul_i(VI v, float s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s)); }
// float(v) * s - m, fused
inline VF fmsub_i(VI v, float s, VF m) { return _mm256_fmsub_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), m); }
inline VI shl32(VI a, int s) { return _mm256_slli_epi32(a, s); }
// i16 lane i = u[2i] * s[2i] + u[2i+1] * s[2i+1]   (u unsigned, s signed bytes)
inline VI maddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
// i32 lane i = a[2i] * b[2i] + a[2i+1] * b[2i+1]
inline VI madd(VI a, VI b) { return _mm256_madd_epi16(a, b); }
// i32 lane i = sum of u[4i + j] * s[4i + j], j < 4 (no i16 saturation here: see the callers)
inline VI dot4(VI u, VI s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(zero(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), set16(1));
#endif
}
// bytes 0-15 from a, 16-31 from b
inline VI join16(const __m128i a, const __m128i b) { return _mm256_set_m128i(b, a); }
inline VI nibbles16(const uint8_t* p) {  // 16 bytes -> 16 low nibbles then 16 high nibbles
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return join16(_mm_and_si128(q, m), _mm_and_si128(_mm_srli_epi16(q, 4), m));
}
// byte i = 0x10 if bit i of the 32-bit word at p is set, else 0
inline VI bit4_from_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const VI spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                          0x0101010101010101LL, 0x0000000000000000LL));
  const VI select = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), set8(0x10));
}
// the 4 bytes at p in every 32-bit lane
inline VI bcast32v(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// i16 a + b, one vpaddw the compiler cannot reassociate: with the intrinsic, GCC turned each chain of sums
// into a tree that kept every product live, spilled to the stack; the saturating add, which it leaves alone,
// runs on half the ports (Zen 4: maddubs + adds 1 a cycle, maddubs + add 1.6)
inline VI add16(VI a, VI b) {
#if defined(__GNUC__)
  __asm__("vpaddw %1, %0, %0" : "+x"(a) : "x"(b));
  return a;
#else
  return _mm256_add_epi16(a, b);
#endif
}
// 8 scales (bytes at p, unsigned or signed) as 8 lanes of (s, s) i16 pairs: madd(v, pairs) = s x (v0 + v1)
inline VI scale_pairs_u8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}
inline VI scale_pairs_i8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}
inline VF fzero() { return _mm256_setzero_ps(); }
// acc + float(v) * s, fused
inline VF fmadd_i(VI v, float s, VF acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc); }
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float hsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VI scales16(const int8_t* sc) {  // 16 signed bytes -> 16 x i16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
}
inline VI pair16(int16_t a, int16_t b) {  // lanes 0-7 = a, 8-15 = b
  return _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a));
}
inline VI widen32(uint64_t v) {  // byte j of v -> i32 lane j (as i16 lanes: b0 0 b1 0 ... b7 0)
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(v)));
}

}  // namespace
}  // namespace SPECDEC_QLIB
