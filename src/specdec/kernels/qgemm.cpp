// Matrix products on GGUF's own quantized blocks:  y[M, N] = x[M, K] @ W[N, K].T (+ bias)
//
// W stays in the file's block format (Q4_0, Q5_0, Q8_0: 32 weights a block; Q4_K, Q5_K, Q6_K: 256), one
// row of blocks per output channel, read in place (a memory map of the GGUF).  Each activation row is
// quantized to 8 bits per block (scale amax / 127, one scale per 256 values for the k-quants, per 32 for
// the others, plus sums of every 16 quants), weight block x activation block products are integer dot
// products (exact, so their order does not matter), and block results are combined in fp32.
//
// Row invariance, by construction: the bits of y[m, n] depend only on row m of x and row n of W.  For the
// k-quants each (row, channel, 256-value block) gives exact integers (S = the sum of scale x weight x
// activation over the block; Q4_K / Q5_K also Mn = the sum of min x activation), and the channel's fp32 value
// takes one step per block, in block order (`step45` / `step6`: the same few IEEE operations everywhere).
// The 32-value types keep, per (row, channel), 8 int32 lanes per block and 8 fp32 lanes over the row,
// reduced by one fixed horizontal sum.  Integers are exact (no saturation: weights are at most 6 bits
// unsigned, or signed 8 bits through the sign trick, activations lie in [-127, 127]), so however a build
// gets them (AVX2 maddubs + madd, AVX-512 VNNI, AMX tile products, scalar code) and whatever other rows,
// row count or thread computes alongside, the fp32 steps see the same values and give the same bits.
//
// Registered as torch.ops.<library>.qmm; the library name comes from -DSPECDEC_QLIB (one per ISA build).

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "attention.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(SPECDEC_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef SPECDEC_QLIB
#define SPECDEC_QLIB specdec_qgemm
#endif

namespace {

// GGML type ids (ggml.h)
enum : int64_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
// Q4_K / Q6_K / Q4_0 / Q5_0 blocks of 16 channels interleaved (`repack_q4k_x16`, `repack_q6k_x16`,
// `repack_q40_x16`, `repack_q50_x16`): not GGML types, the kernels' own layouts (type + 100)
constexpr int64_t kQ4_KX16 = 112, kQ6_KX16 = 114, kQ4_0X16 = 102, kQ5_0X16 = 106;
inline bool is_x16_k(int64_t t) { return t == kQ4_KX16 || t == kQ6_KX16; }
inline bool is_x16(int64_t t) { return is_x16_k(t) || t == kQ4_0X16 || t == kQ5_0X16; }

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

// ---- 32-byte vectors: 32 x u8/i8, 16 x i16, 8 x i32 or 8 x f32 -------------------------------------
// Each operation is defined lane by lane (the scalar code says what), so that the AVX2 and portable
// builds compute the same values.

#if defined(__AVX2__)
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
#else
union VI {
  uint8_t u[32];
  int8_t b[32];
  int16_t h[16];
  int32_t w[8];
};
struct VF {
  float f[8];
};
inline VI load(const void* p) { VI v; std::memcpy(v.u, p, 32); return v; }
inline VI zero() { VI v; std::memset(v.u, 0, 32); return v; }
inline VI set8(int8_t x) { VI v; for (int i = 0; i < 32; ++i) v.b[i] = x; return v; }
inline VI set16(int16_t x) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = x; return v; }
inline VI and_(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] &= b.u[i]; return a; }
inline VI or_(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] |= b.u[i]; return a; }
inline VI shr_mask(VI b, int s, int8_t mask) {
  for (int i = 0; i < 32; ++i) b.u[i] = static_cast<uint8_t>((b.u[i] >> s) & static_cast<uint8_t>(mask));
  return b;
}
inline VI shl4(VI b) { for (int i = 0; i < 32; ++i) b.u[i] = static_cast<uint8_t>(b.u[i] << 4); return b; }
inline VI sub8(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] = static_cast<uint8_t>(a.u[i] - b.u[i]); return a; }
inline VI abs8(VI a) {
  for (int i = 0; i < 32; ++i) a.u[i] = static_cast<uint8_t>(a.b[i] < 0 ? -static_cast<int>(a.b[i]) : a.b[i]);
  return a;
}
inline VI sign8(VI a, VI b) {
  for (int i = 0; i < 32; ++i)
    a.b[i] = static_cast<int8_t>(b.b[i] < 0 ? -static_cast<int>(a.b[i]) : (b.b[i] == 0 ? 0 : a.b[i]));
  return a;
}
inline VI sub32(VI a, VI b) { for (int i = 0; i < 8; ++i) a.w[i] -= b.w[i]; return a; }
inline VI add32(VI a, VI b) { for (int i = 0; i < 8; ++i) a.w[i] += b.w[i]; return a; }
inline VF fadd(VF a, VF b) { for (int i = 0; i < 8; ++i) a.f[i] += b.f[i]; return a; }
inline VF fmul_i(VI v, float s) { VF r; for (int i = 0; i < 8; ++i) r.f[i] = static_cast<float>(v.w[i]) * s; return r; }
inline VF fmsub_i(VI v, float s, VF m) {
  VF r;
  for (int i = 0; i < 8; ++i) r.f[i] = std::fma(static_cast<float>(v.w[i]), s, -m.f[i]);
  return r;
}
inline VI shl32(VI a, int s) { for (int i = 0; i < 8; ++i) a.w[i] = static_cast<int32_t>(static_cast<uint32_t>(a.w[i]) << s); return a; }
inline VI maddubs(VI u, VI s) {
  VI r;
  for (int i = 0; i < 16; ++i) {
    int v = u.u[2 * i] * s.b[2 * i] + u.u[2 * i + 1] * s.b[2 * i + 1];
    r.h[i] = static_cast<int16_t>(std::min(32767, std::max(-32768, v)));
  }
  return r;
}
inline VI madd(VI a, VI b) {
  VI r;
  for (int i = 0; i < 8; ++i) r.w[i] = a.h[2 * i] * b.h[2 * i] + a.h[2 * i + 1] * b.h[2 * i + 1];
  return r;
}
inline VI dot4(VI u, VI s) {
  VI r;
  for (int i = 0; i < 8; ++i) {
    int32_t t = 0;
    for (int j = 0; j < 4; ++j) t += u.u[4 * i + j] * s.b[4 * i + j];
    r.w[i] = t;
  }
  return r;
}
inline VI nibbles16(const uint8_t* p) {
  VI v;
  for (int i = 0; i < 16; ++i) {
    v.u[i] = p[i] & 0x0F;
    v.u[16 + i] = p[i] >> 4;
  }
  return v;
}
inline VI bit4_from_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  VI v;
  for (int i = 0; i < 32; ++i) v.u[i] = ((bits >> i) & 1) ? 0x10 : 0;
  return v;
}
inline VF fzero() { VF v; for (int i = 0; i < 8; ++i) v.f[i] = 0.f; return v; }
inline VF fmadd_i(VI v, float s, VF acc) {
  for (int i = 0; i < 8; ++i) acc.f[i] = std::fma(static_cast<float>(v.w[i]), s, acc.f[i]);
  return acc;
}
inline float hsum(VF v) {
  const float* l = v.f;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
inline VI scales16(const int8_t* sc) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = sc[i]; return v; }
inline VI pair16(int16_t a, int16_t b) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = i < 8 ? a : b; return v; }
inline VI widen32(uint64_t v) { VI r; for (int i = 0; i < 8; ++i) r.w[i] = static_cast<uint8_t>(v >> (8 * i)); return r; }
#endif

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

// One k-quant block's fp32 step for a (row, channel), from its exact integers; every path of every build
// computes exactly these operations (vectorized ones lane by lane): f + (S * (dx d) - Mn * (dx dmin)), the
// product with S fused (Q4_K / Q5_K), and f + S * (dx d), fused (Q6_K).
inline float step45(float f, int32_t S, int32_t Mn, float dx, float d, float dmin) {
  return f + std::fma(static_cast<float>(S), dx * d, -(static_cast<float>(Mn) * (dx * dmin)));
}
inline float step6(float f, int32_t S, float dx, float d) { return std::fma(static_cast<float>(S), dx * d, f); }

// Two sub-block sums (each fits 16 bits) as one int32: lo in the low half, hi in the high half, the layout
// `madd_epi16` / the tiles read them in.
inline int32_t pack_i16x2(int32_t lo, int32_t hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) | (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

// ---- quantized activations ----------------------------------------------------------------------

// Q4_K / Q5_K in the 512-bit kernels: the 256 quants of a block are unpacked into 4 registers of 64 bytes
// such that every 32-bit lane holds 4 quants of one sub-block, the same sub-block in registers 0 and 1
// (the even ones: 0, 0, 2, 2, 4, 4, 6, 6 by pairs of lanes, twice) and in registers 2 and 3 (the odd ones).
// The quant at byte v of register g: sub-block 2 ((v / 8) % 4) + g / 2, its values 16 (g % 2) + 8 (v / 32)
// + v % 8.  Returns its index in the block (v a multiple of 8: 8 consecutive quants).
constexpr int64_t q45k_lane(int g, int v) {
  return 32 * (2 * ((v / 8) % 4) + g / 2) + 16 * (g % 2) + 8 * (v / 32) + v % 8;
}
// Q6_K in the 512-bit kernels: 32-bit lane L of each of a block's 4 registers holds quants of sub-block
// q6k_sub(L) (register c: its values 4c..4c + 3).
constexpr int q6k_sub(int L) { return 4 * (L % 4) + L / 4; }

struct Acts {
  int64_t M = 0, K = 0, bs = 0;  // rows, row length, block size (32 or 256)
  std::vector<int8_t> q;         // [M][K]
  std::vector<int16_t> s;        // [M][K / 16]: sums of 16 quants
  std::vector<int32_t> s32;      // [M][K / 32]: sums of 32 quants
  std::vector<int16_t> s32h;     // [M][K / 32]: the same as i16 (they fit)
  std::vector<uint8_t> s32lo;    // [M][K / 32]: their low bytes
  std::vector<int8_t> s32hi;     // [M][K / 32]: the rest (sum >> 8, in [-16, 15]): sum = lo + 256 hi
  std::vector<float> d;          // [M][K / bs]: block scales
  // bs = 256, rows side by side: dT [K / 256][M] block scales, bsT [K / 256][4][M] the sums of sub-blocks
  // (2t, 2t + 1) as an i16 pair
  std::vector<float> dT;
  std::vector<int32_t> bsT;
  // bs = 256, the 512-bit two-channel kernels, M = 2: the group of 2 rows interleaved so
  // that a group's rows are read from one pointer: qg (from m0 K) [block][64-value chunk][row][64], sg (from
  // m0 K / 16) [block][row][16 sums]
  std::vector<int8_t> qg;
  std::vector<int16_t> sg;
  // bs = 256, the 512-bit Q4_K / Q5_K kernels (any M): each 256-value block of a row in the order their
  // weight registers hold the quants (`q45k_lane`), each group of rows interleaved as in qg: qp
  // (from m0 K) [block][register][row][64]
  std::vector<int8_t> qp;
  const int8_t* qperm(int64_t m0) const { return qp.data() + m0 * K; }
  // bs = 256, the 512-bit Q6_K kernels (any M): byte 4L + t of register c of a block is its quant
  // 16 q6k_sub(L) + 4 c + t, groups interleaved: q6 (from m0 K) [block][register][row][64]; o6 (from m0 K / 16)
  // [block][row][16]: lane L, -32 x the sum of sub-block q6k_sub(L)'s 16 quants (Q6_K's offset)
  std::vector<int8_t> q6;
  std::vector<int32_t> o6;
  const int8_t* q6perm(int64_t m0) const { return q6.data() + m0 * K; }
  const int32_t* o6group(int64_t m0) const { return o6.data() + m0 * (K / 16); }
  const int8_t* qgroup(int64_t m0) const { return (qg.empty() ? q.data() : qg.data()) + m0 * K; }
  const int16_t* sgroup(int64_t m0) const { return (sg.empty() ? s.data() : sg.data()) + m0 * (K / 16); }
  const int8_t* qrow(int64_t m) const { return q.data() + m * K; }
  const int16_t* srow(int64_t m) const { return s.data() + m * (K / 16); }
  const int32_t* s32row(int64_t m) const { return s32.data() + m * (K / 32); }
  const int16_t* s32hrow(int64_t m) const { return s32h.data() + m * (K / 32); }
  const uint8_t* s32lorow(int64_t m) const { return s32lo.data() + m * (K / 32); }
  const int8_t* s32hirow(int64_t m) const { return s32hi.data() + m * (K / 32); }
  const float* drow(int64_t m) const { return d.data() + m * (K / bs); }
};

// The rows of a group, resolved once per call of a kernel (no index arithmetic in the block loops).
template <int R>
struct Rows {
  const int8_t* q[R];
  const int16_t* s[R];
  const int32_t* s32[R];
  const float* d[R];
  const uint8_t* lo[R];  // s32's low bytes and the rest
  const int8_t* hi[R];
  Rows(const Acts& a, int64_t m0) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.qrow(m0 + r);
      s[r] = a.srow(m0 + r);
      s32[r] = a.s32row(m0 + r);
      d[r] = a.drow(m0 + r);
      lo[r] = a.s32lorow(m0 + r);
      hi[r] = a.s32hirow(m0 + r);
    }
  }
};

// One row, one block: scale = amax / 127, q = round-half-even(x * 127 / amax), in [-127, 127], and the sums of
// every 16 quants. Elementwise IEEE operations only (the maximum is order-free; where x holds a NaN, it is
// skipped by the maximum and becomes -127, in both forms), so the vector form below gives the bytes of the
// scalar one.
inline void quantize_block_scalar(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
  float amax = 0.f;
  for (int64_t i = 0; i < bs; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  *d = amax / 127.f;
  for (int64_t i = 0; i < bs; ++i) {
    float v = std::nearbyint(x[i] * id);
    v = std::min(127.f, std::max(-127.f, v));
    q[i] = static_cast<int8_t>(v);
  }
  for (int64_t g = 0; g < bs / 16; ++g) {
    int32_t t = 0;
    for (int i = 0; i < 16; ++i) t += q[g * 16 + i];
    s[g] = static_cast<int16_t>(t);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void quantize_block(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
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
}
#else
inline void quantize_block(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) { quantize_block_scalar(x, bs, q, s, d); }
#endif

inline void bf16_to_f32(const at::BFloat16* x, int64_t n, float* y) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= n; k += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
    _mm512_storeu_ps(y + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#endif
  for (; k < n; ++k) y[k] = static_cast<float>(x[k]);
}

// `orders` (bs = 256, the 512-bit builds): which of the kernels' orders to lay out, a bit each: kOrderQ45 (qp,
// Q4_K / Q5_K), kOrderQ6 (q6 and o6, Q6_K); the file's order for the two-channel kernels (qg, sg) when M = 2.
enum : int { kOrderQ45 = 1, kOrderQ6 = 2 };
void quantize_rows(const at::Tensor& x, int64_t bs, Acts& a, int orders = kOrderQ45 | kOrderQ6) {
  const int64_t M = x.size(0), K = x.size(1);
  a.K = K;
  a.bs = bs;
  a.q.resize(M * K);
  a.s.resize(M * (K / 16));
  a.s32.resize(M * (K / 32));
  a.s32h.resize(M * (K / 32));
  a.s32lo.resize(M * (K / 32));
  a.s32hi.resize(M * (K / 32));
  a.d.resize(M * (K / bs));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const at::BFloat16* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / K), [&](int64_t m0, int64_t m1) {
    std::vector<float> row(bf16 ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = xf + m * K;
      if (bf16) {
        bf16_to_f32(xb + m * K, K, row.data());
        r = row.data();
      }
      for (int64_t b = 0; b < K / bs; ++b)
        quantize_block(r + b * bs, bs, a.q.data() + m * K + b * bs, a.s.data() + m * (K / 16) + b * (bs / 16),
                       a.d.data() + m * (K / bs) + b);
      const int16_t* s16 = a.s.data() + m * (K / 16);
      for (int64_t g = 0; g < K / 32; ++g) {
        a.s32[m * (K / 32) + g] = s16[2 * g] + s16[2 * g + 1];
        const int32_t sum = s16[2 * g] + s16[2 * g + 1];  // |sum| <= 32 x 127
        a.s32h[m * (K / 32) + g] = static_cast<int16_t>(sum);
        a.s32lo[m * (K / 32) + g] = static_cast<uint8_t>(sum & 0xFF);
        a.s32hi[m * (K / 32) + g] = static_cast<int8_t>(sum >> 8);
      }
    }
  });
  a.M = M;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  a.qg.clear();
  a.sg.clear();
  a.qp.clear();
  if (bs == 256) {  // each group's rows interleaved block by block, in the orders its kernels read
    const int64_t nb = K / 256;
    // qg / sg: the two-channel kernels run groups of 2 rows (even groups have 2 rows only when M = 2; one row
    // reads q itself)
    const bool natural = M == 2, q45 = orders & kOrderQ45, q6 = orders & kOrderQ6;
    if (q45) a.qp.resize(M * K);
    if (q6) {
      a.q6.resize(M * K);
      a.o6.resize(M * (K / 16));
    }
    if (natural) {
      a.qg.resize(M * K);
      a.sg.resize(M * (K / 16));
    }
    for (int64_t g = 0; g < row_groups(M); ++g) {
      const int64_t m0 = group_start(M, g), R = group_start(M, g + 1) - m0;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < nb; ++i) {
          const int8_t* src = a.q.data() + (m0 + r) * K + i * 256;
          const int16_t* sums = a.s.data() + (m0 + r) * (K / 16) + i * 16;
          for (int c = 0; c < 4; ++c) {  // register c of the block: 64 bytes in each order
            const int64_t at = m0 * K + ((i * 4 + c) * R + r) * 64;
            if (q45)
              for (int v = 0; v < 64; v += 8) std::memcpy(a.qp.data() + at + v, src + q45k_lane(c, v), 8);
            if (q6)
              for (int L = 0; L < 16; ++L) std::memcpy(a.q6.data() + at + 4 * L, src + 16 * q6k_sub(L) + 4 * c, 4);
            if (natural) std::memcpy(a.qg.data() + at, src + 64 * c, 64);
          }
          const int64_t at16 = m0 * (K / 16) + (i * R + r) * 16;
          if (q6)
            for (int L = 0; L < 16; ++L) a.o6[at16 + L] = -32 * sums[q6k_sub(L)];
          if (natural) std::memcpy(a.sg.data() + at16, sums, 32);
        }
    }
  }
#endif
  if (bs == 256) {
    const int64_t nb = K / 256;
    a.dT.resize(nb * M);
    a.bsT.resize(nb * 4 * M);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < nb; ++i) {
        a.dT[i * M + m] = a.d[m * nb + i];
        const int32_t* s32 = a.s32.data() + m * (K / 32) + 8 * i;
        for (int t = 0; t < 4; ++t)
          a.bsT[(i * 4 + t) * M + m] = pack_i16x2(s32[2 * t], s32[2 * t + 1]);
      }
  }
}

// ---- one output channel, R rows -------------------------------------------------------------------
// Each kernel adds row r's dot product with weight row `w` (nb blocks) into out[r] (a plain store).
//
// Weights are read front to back, row after row of a tile; each block read also asks for the bytes
// kAhead further on (the rows after), so that they come from memory while this block is computed. The
// hardware prefetchers alone (they stop at page boundaries and ramp up anew) left the default target's
// one-token step at 82 ms instead of 62 (`benchmarks/bench_kernels.py`).
constexpr int64_t kAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, int64_t n) {
  for (int64_t l = 0; l < n; l += 64) __builtin_prefetch(p + kAhead + l, 0, 3);
}

// Q4_K / Q5_K: the 8 six-bit (scale, min) pairs packed in 12 bytes. Bytes 0-3 hold scales 0-3 in their low
// 6 bits, bytes 4-7 mins 0-3; pairs 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from
// the top bits of bytes 0-3 (scales) and 4-7 (mins). Four bytes at a time.
__attribute__((always_inline)) inline void k_scales_mins(const uint8_t* q, uint64_t* sc, uint64_t* mn) {  // byte j of *sc: scale j
  uint32_t u[3];
  std::memcpy(u, q, 12);
  *sc = (u[0] & 0x3f3f3f3fu) | (static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32);
  *mn = (u[1] & 0x3f3f3f3fu) | (static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32);
}
inline uint8_t byte_of(uint64_t v, int j) { return static_cast<uint8_t>(v >> (8 * j)); }

// Q4_K (144 bytes: d, dmin, 12 bytes of scales/mins, 128 of nibbles) and Q5_K (176: + 32 bytes of high bits).
template <int R, bool Q5>
void dot_q45k(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  constexpr int64_t bytes = Q5 ? 176 : 144;
  float f[R];
  for (int r = 0; r < R; ++r) f[r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    prefetch_ahead(b, bytes);
    const float d = fp16(b), dmin = fp16(b + 2);
    uint64_t sc, mn;
    k_scales_mins(b + 4, &sc, &mn);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (Q5 ? 48 : 16);
    const VI hbits = Q5 ? load(qh) : zero();
    VI acc[R], acc2[R];  // two independent chains per row (integer sums: their split changes nothing)
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = zero();
    for (int j = 0; j < 4; ++j) {
      const VI q = load(qs + 32 * j);
      VI lo = and_(q, set8(0x0F)), hi = shr_mask(q, 4, 0x0F);
      if (Q5) {
        lo = or_(lo, shl4(shr_mask(hbits, 2 * j, 1)));
        hi = or_(hi, shl4(shr_mask(hbits, 2 * j + 1, 1)));
      }
      const VI slo = set16(byte_of(sc, 2 * j)), shi = set16(byte_of(sc, 2 * j + 1));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = rw.q[r] + i * 256 + 64 * j;
        acc[r] = add32(acc[r], madd(maddubs(lo, load(x)), slo));
        acc2[r] = add32(acc2[r], madd(maddubs(hi, load(x + 32)), shi));
      }
    }
    const VI mins = widen32(mn);
    for (int r = 0; r < R; ++r) {
      const int32_t mnsum = hsum_i(madd(load(rw.s32[r] + i * 8), mins));  // sum of min j * sum of sub-block j
      f[r] = step45(f[r], hsum_i(add32(acc[r], acc2[r])), mnsum, rw.d[r][i], d, dmin);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = f[r];
}

// Q6_K (210 bytes: 128 of low nibbles, 64 of 2-bit highs, 16 int8 scales, d): w = d * sc * (q - 32).
template <int R>
void dot_q6k(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  float f[R];
  for (int r = 0; r < R; ++r) f[r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * 210;
    prefetch_ahead(b, 210);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16(b + 208);
    VI acc[R], acc2[R];  // two independent chains per row (integer sums: their split changes nothing)
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = zero();
    for (int h = 0; h < 2; ++h) {
      const VI l0 = load(b + 64 * h), l1 = load(b + 64 * h + 32), hb = load(b + 128 + 32 * h);
      const VI c[4] = {
          or_(and_(l0, set8(0x0F)), shl4(and_(hb, set8(3)))),
          or_(and_(l1, set8(0x0F)), shl4(shr_mask(hb, 2, 3))),
          or_(shr_mask(l0, 4, 0x0F), shl4(shr_mask(hb, 4, 3))),
          or_(shr_mask(l1, 4, 0x0F), shl4(shr_mask(hb, 6, 3))),
      };
      for (int k = 0; k < 4; k += 2) {
        const VI s0 = pair16(sc[8 * h + 2 * k], sc[8 * h + 2 * k + 1]);
        const VI s1 = pair16(sc[8 * h + 2 * k + 2], sc[8 * h + 2 * k + 3]);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = rw.q[r] + i * 256 + 128 * h + 32 * k;
          acc[r] = add32(acc[r], madd(maddubs(c[k], load(x)), s0));
          acc2[r] = add32(acc2[r], madd(maddubs(c[k + 1], load(x + 32)), s1));
        }
      }
    }
    const VI s16 = scales16(sc);
    for (int r = 0; r < R; ++r) {
      const VI corr = madd(load(rw.s[r] + i * 16), s16);  // the -32 offset: 32 * sum(sc * bsum)
      f[r] = step6(f[r], hsum_i(sub32(add32(acc[r], acc2[r]), shl32(corr, 5))), rw.d[r][i], d);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = f[r];
}

// 32-weight blocks with one fp16 scale: Q8_0 (int8), Q4_0 (nibble - 8), Q5_0 (5 bits - 16).
template <int64_t T>
inline VI q32_weights(const uint8_t* b) {  // the 32 weights of a block as signed bytes
  if (T == kQ8_0) return load(b + 2);
  if (T == kQ4_0) return sub8(nibbles16(b + 2), set8(8));
  return sub8(or_(nibbles16(b + 6), bit4_from_bits(b + 2)), set8(16));
}

template <int R, int64_t T>
void dot_q32(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  constexpr int64_t bytes = T == kQ8_0 ? 34 : (T == kQ4_0 ? 18 : 22);
  VF f[2][R];  // even and odd blocks on two chains, added at the end
  for (int r = 0; r < R; ++r) f[0][r] = f[1][r] = fzero();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    prefetch_ahead(b, bytes);
    const float d = fp16(b);
    VF* fi = f[i & 1];
    const VI q = q32_weights<T>(b);
    const VI aq = abs8(q);
    for (int r = 0; r < R; ++r) {
      const VI l = dot4(aq, sign8(load(rw.q[r] + i * 32), q));
      fi[r] = fmadd_i(l, rw.d[r][i] * d, fi[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(fadd(f[0][r], f[1][r]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The same kernels on 512-bit vectors: one zmm holds what the 256-bit code keeps in its two chains
// (lanes 0-7: acc / even blocks, lanes 8-15: acc2 / odd blocks), so every integer lane, and every fp32
// lane after the halves are added, is the value the 256-bit code computes: the same bits, half the
// instructions per row.
#define SPECDEC_Z512 1
inline __m512i bcast256(VI v) { return _mm512_broadcast_i64x4(v); }
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

// Q4_K / Q5_K: the permutations giving chunk j's scales (i16 lanes 0-15: scale 2j, 16-31: scale 2j + 1), and
// the quants of chunk j ([low nibbles | high nibbles] of 32 bytes: sub-blocks 2j and 2j + 1; Q5_K: plus the
// fifth bit from the block's 32 high-bit bytes `hb`, broadcast to both halves).
inline void q45k_picks(__m512i* pick) {
  for (int j = 0; j < 4; ++j) pick[j] = shifts(2 * j, 2 * j + 1);
}
template <bool Q5>
inline __m512i q45k_quants(const uint8_t* qs, __m512i hb, int j) {
  __m512i q = _mm512_and_si512(_mm512_srlv_epi16(bcast256(load(qs + 32 * j)), shifts(0, 4)), _mm512_set1_epi8(0x0F));
  if (Q5) {
    const __m512i h = _mm512_and_si512(_mm512_srlv_epi16(hb, shifts(2 * j, 2 * j + 1)), _mm512_set1_epi8(1));
    q = _mm512_or_si512(q, _mm512_slli_epi16(h, 4));
  }
  return q;
}

// Two channels (C = 2) at a time for one or two rows, on the quants as the file holds them: two independent
// weight streams keep some cores busy where one row leaves them waiting on latencies (whether they run is
// measured at load: see `dot2_fn`); out[c * R + r].
template <int R, int C, bool Q5>
void dot_q45k_zc(const uint8_t* const* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  const int8_t* xg = a.qgroup(m0);
  constexpr int64_t bytes = Q5 ? 176 : 144;
  __m512i pick[4];
  q45k_picks(pick);
  float f[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) f[c][r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    float d[C], dmin[C];
    uint64_t mn[C];
    __m512i scz[C], hb[C];
    const uint8_t* qs[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* b = w[c] + i * bytes;
      prefetch_ahead(b, bytes);
      d[c] = fp16(b);
      dmin[c] = fp16(b + 2);
      uint64_t sc;
      k_scales_mins(b + 4, &sc, &mn[c]);
      scz[c] = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      qs[c] = b + (Q5 ? 48 : 16);
      hb[c] = Q5 ? bcast256(load(b + 16)) : _mm512_setzero_si512();
    }
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i x[R];
      for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_si512(xg + (i * 4 + j) * R * 64 + r * 64);
      for (int c = 0; c < C; ++c) {
        const __m512i q = q45k_quants<Q5>(qs[c], hb[c], j);
        const __m512i s = _mm512_permutexvar_epi16(pick[j], scz[c]);
        for (int r = 0; r < R; ++r) acc[c][r] = madd_acc_z<R * C>(acc[c][r], _mm512_maddubs_epi16(q, x[r]), s);
      }
    }
    VI mins[C];
    for (int c = 0; c < C; ++c) mins[c] = widen32(mn[c]);
    for (int k = 0; k < C * R; k += 2) {  // items (channel, row) two at a time: S and Mn, then the steps
      const int k1 = k + 1 < C * R ? k + 1 : k, c0 = k / R, r0 = k % R, c1 = k1 / R, r1 = k1 % R;
      int32_t v[4];
      sums2(acc[c0][r0], acc[c1][r1], madd(load(rw.s32[r0] + i * 8), mins[c0]), madd(load(rw.s32[r1] + i * 8), mins[c1]), v);
      f[c0][r0] = step45(f[c0][r0], v[0], v[2], rw.d[r0][i], d[c0], dmin[c0]);
      if (k1 != k) f[c1][r1] = step45(f[c1][r1], v[1], v[3], rw.d[r1][i], d[c1], dmin[c1]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c * R + r] = f[c][r];
}

// Q6_K: the permutations that give, for chunk pair h and half k of a block, the scales of its four 16-value
// groups (8 i16 lanes each), and the 6-bit quants of chunks (2h, 2h + 1) from a block's low and high bits.
inline void q6k_picks(__m512i* pick) {
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {
      const int g = 8 * h + 4 * k;
      pick[2 * h + k] = _mm512_inserti64x4(
          _mm512_castsi256_si512(pair16(static_cast<int16_t>(g), static_cast<int16_t>(g + 1))),
          pair16(static_cast<int16_t>(g + 2), static_cast<int16_t>(g + 3)), 1);
    }
}
inline void q6k_quants(const uint8_t* b, int h, __m512i* q) {
  const __m512i m0f = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
  const __m512i l = _mm512_loadu_si512(b + 64 * h);  // low nibbles of chunks 0|1, high of 2|3
  const __m512i hb = bcast256(load(b + 128 + 32 * h));
  q[0] = _mm512_or_si512(_mm512_and_si512(l, m0f),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, shifts(0, 2)), m3), 4));
  q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, shifts(4, 6)), m3), 4));
}

template <int R, int C>
void dot_q6k_zc(const uint8_t* const* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  const int8_t* xg = a.qgroup(m0);
  const int16_t* sg = a.sgroup(m0);
  __m512i pick[4];  // for (h, k): the scales of the four 16-value groups of 64 values, 8 i16 lanes each
  q6k_picks(pick);
  float f[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) f[c][r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b[C];
    __m512i s16z[C];
    for (int c = 0; c < C; ++c) {
      b[c] = w[c] + i * 210;
      prefetch_ahead(b[c], 210);
      s16z[c] = _mm512_castsi256_si512(scales16(reinterpret_cast<const int8_t*>(b[c] + 192)));
    }
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < C; ++c) {
        __m512i q[2];
        q6k_quants(b[c], h, q);
        for (int k = 0; k < 2; ++k) {
          const __m512i s = _mm512_permutexvar_epi16(pick[2 * h + k], s16z[c]);
          for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_loadu_si512(xg + (i * 4 + 2 * h + k) * R * 64 + r * 64);
            acc[c][r] = madd_acc_z<R * C>(acc[c][r], _mm512_maddubs_epi16(q[k], x), s);
          }
        }
      }
    }
    VI s16[C];
    float d[C];
    for (int c = 0; c < C; ++c) {
      s16[c] = scales16(reinterpret_cast<const int8_t*>(b[c] + 192));
      d[c] = fp16(b[c] + 208);
    }
    for (int k = 0; k < C * R; k += 2) {  // items (channel, row) two at a time; the -32 offset: 32 sum(sc bsum)
      const int k1 = k + 1 < C * R ? k + 1 : k, c0 = k / R, r0 = k % R, c1 = k1 / R, r1 = k1 % R;
      int32_t v[4];
      sums2(acc[c0][r0], acc[c1][r1], shl32(madd(load(sg + (i * R + r0) * 16), s16[c0]), 5),
            shl32(madd(load(sg + (i * R + r1) * 16), s16[c1]), 5), v);
      f[c0][r0] = step6(f[c0][r0], v[0] - v[2], rw.d[r0][i], d[c0]);
      if (k1 != k) f[c1][r1] = step6(f[c1][r1], v[1] - v[3], rw.d[r1][i], d[c1]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c * R + r] = f[c][r];
}

// Q4_K / Q5_K with the quants in fixed lanes (`q45k_lane`): a block's 128 bytes of nibbles are regrouped by
// 64-bit words (two permutes), so that after the nibble split every 32-bit lane of registers 0 and 1 holds
// quants of one even sub-block and of registers 2 and 3 one odd sub-block. The integer dot products then
// accumulate over two registers before a scale is applied: per row, 4 u8 x s8 dot products (VNNI) and 2
// i16 multiply-adds by the scales (the lane sums fit 16 bits: 8 quants below 32 times activations in
// [-127, 127]), where the kernels on the file's order of quants need 4 u8 x s8 products to i16 and 4 i16
// multiply-adds (and word shifts and permutes per block). S and Mn are the exact integers of the other
// kernels, so the fp32 steps, and the bits, are theirs.
struct Q45kRegs {
  __m512i q[4];    // the quants in the lanes of `q45k_lane`
  __m512i sc[2];   // per 32-bit lane: the scale of its even (odd) sub-block as i16, then 0
  uint64_t mn;     // byte j: the min of sub-block j
};
template <bool Q5>
inline Q45kRegs q45k_regs(const uint8_t* b) {
  const __m512i lo = _mm512_loadu_si512(b + (Q5 ? 48 : 16)), hi = _mm512_loadu_si512(b + (Q5 ? 112 : 80));
  // 64-bit words of quant bytes: [0, 4, 8, 12, 1, 5, 9, 13] (values 0-15 of each pair of sub-blocks) and the
  // rest (values 16-31)
  const __m512i g0 = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0), hi);
  const __m512i g1 = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2), hi);
  const __m512i m = _mm512_set1_epi8(0x0F);
  Q45kRegs r;
  r.q[0] = _mm512_and_si512(g0, m);
  r.q[1] = _mm512_and_si512(g1, m);
  r.q[2] = _mm512_and_si512(_mm512_srli_epi16(g0, 4), m);
  r.q[3] = _mm512_and_si512(_mm512_srli_epi16(g1, 4), m);
  if (Q5) {  // the fifth bit of sub-block s, value v: bit s of byte v of the 32 high-bit bytes
    const __m512i hb = bcast256(load(b + 16));
    const __m512i w[2] = {_mm512_permutexvar_epi64(_mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0), hb),   // values 0-15
                          _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 3, 3, 2, 2, 2, 2), hb)};  // 16-31
    const __m512i sh = _mm512_set_epi64(6, 4, 2, 0, 6, 4, 2, 0), one = _mm512_set1_epi8(1);
    for (int g = 0; g < 4; ++g) {
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(w[g % 2], _mm512_add_epi64(sh, _mm512_set1_epi64(g / 2))), one);
      r.q[g] = _mm512_or_si512(r.q[g], _mm512_slli_epi16(bit, 4));
    }
  }
  uint64_t sc;
  k_scales_mins(b + 4, &sc, &r.mn);
  // byte 4L of the even (odd) pattern: scale 2 ((L / 2) % 4) (+ 1); the other bytes 0
  const __m512i s8 = _mm512_set1_epi64(static_cast<long long>(sc));
  for (int o = 0; o < 2; ++o) {
    auto p = [o](int m) { return static_cast<int>(0x80808000u + 2 * m + o); };
    r.sc[o] = _mm512_shuffle_epi8(s8, _mm512_set_epi32(p(3), p(3), p(2), p(2), p(1), p(1), p(0), p(0),
                                                       p(3), p(3), p(2), p(2), p(1), p(1), p(0), p(0)));
  }
  return r;
}
// S's 16 lanes for one row: x, the row's 4 registers of the block (`stride` bytes apart)
inline __m512i q45k_lanes_dot(const Q45kRegs& w, const int8_t* x, int64_t stride) {
  const __m512i z = _mm512_setzero_si512();
  __m512i even = _mm512_dpbusd_epi32(z, w.q[0], _mm512_loadu_si512(x));
  even = _mm512_dpbusd_epi32(even, w.q[1], _mm512_loadu_si512(x + stride));
  __m512i odd = _mm512_dpbusd_epi32(z, w.q[2], _mm512_loadu_si512(x + 2 * stride));
  odd = _mm512_dpbusd_epi32(odd, w.q[3], _mm512_loadu_si512(x + 3 * stride));
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(even, w.sc[0]), odd, w.sc[1]);
}

// R = 2..12 rows side by side: a tree for (up to 8) rows' S, Mn from their sub-block sums, a vector fp32 step.
template <int R, bool Q5>
void dot_q45k_fl(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const int8_t* xp = a.qperm(m0);
  constexpr int64_t bytes = Q5 ? 176 : 144;
  constexpr int R0 = R < 8 ? R : 8, R1 = R - R0;  // rows of the first and the second tree
  constexpr __mmask8 rows0 = static_cast<__mmask8>((1u << R0) - 1), rows1 = static_cast<__mmask8>((1u << R1) - 1);
  VF fr[2] = {fzero(), fzero()};
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    prefetch_ahead(b, bytes);
    const Q45kRegs q = q45k_regs<Q5>(b);
    __m512i v[R];
    for (int r = 0; r < R; ++r) v[r] = q45k_lanes_dot(q, xp + (i * 4 * R + r) * 64, R * 64);
    alignas(16) int32_t mp[4];  // mins (2t, 2t + 1) as i16 pairs
    _mm_store_si128(reinterpret_cast<__m128i*>(mp), _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(q.mn))));
    const float d = fp16(b), dmin = fp16(b + 2);
    auto step = [&](auto n, int h, __mmask8 rows) {  // rows 8h.. of the group, n of them
      const VI S = reduce8<decltype(n)::value>(v + 8 * h);
      const int64_t mh = m0 + 8 * h;
      VI Mn = zero();
      for (int t = 0; t < 4; ++t)
        Mn = add32(Mn, madd(_mm256_maskz_loadu_epi32(rows, a.bsT.data() + (i * 4 + t) * a.M + mh), _mm256_set1_epi32(mp[t])));
      const VF dx = _mm256_maskz_loadu_ps(rows, a.dT.data() + i * a.M + mh);
      const VF mv = _mm256_mul_ps(_mm256_cvtepi32_ps(Mn), _mm256_mul_ps(dx, _mm256_set1_ps(dmin)));
      fr[h] = _mm256_add_ps(fr[h], _mm256_fmsub_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dx, _mm256_set1_ps(d)), mv));
    };
    step(std::integral_constant<int, R0>{}, 0, rows0);
    if constexpr (R1 > 0) step(std::integral_constant<int, R1>{}, 1, rows1);
  }
  _mm256_mask_storeu_ps(out, rows0, fr[0]);
  if constexpr (R1 > 0) _mm256_mask_storeu_ps(out + 8, rows1, fr[1]);
}

// One or two rows: no other rows share the horizontal sums of S and Mn, so B = 8 / R blocks x R rows go
// through one tree (lane kR + r: block i0 + k, row r), and the fp32 steps' products run on those 8 lanes at
// once, where the kernel above runs a tree, the rows' Mn and a vector step per block. The adds into each
// row's f stay one after the other, in block order (lane kR + r's operations are step45's: the same bits).
// Mn for the B blocks at once: their mins (as i16) times each row's sums of 32 quants, multiplied and added
// by pairs, then the 4 lanes of each block (a 128-bit lane) summed.
template <int R, bool Q5>
void dot_q45k_flb(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R == 1 || R == 2, "one or two rows");
  constexpr int B = 8 / R, H = B / 4;  // blocks a tree, and 4-block halves of them
  constexpr int64_t bytes = Q5 ? 176 : 144;
  const int8_t* xp = a.qperm(m0);
  const int16_t* s32h[R];
  const float* dxr[R];
  for (int r = 0; r < R; ++r) {
    s32h[r] = a.s32hrow(m0 + r);
    dxr[r] = a.drow(m0 + r);
  }
  alignas(32) int32_t pick[8];  // lane kR + r: lane 4 (k % 4) of Mn's sums for (half k / 4, row r)
  for (int k = 0; k < B; ++k)
    for (int r = 0; r < R; ++r) pick[k * R + r] = 16 * (R == 1 ? k / 4 : r) + 4 * (k % 4);
  const __m512i gather = _mm512_zextsi256_si512(load(pick));
  float f[R] = {};
  for (int64_t i0 = 0; i0 < nb; i0 += B) {
    const int n = static_cast<int>(std::min<int64_t>(B, nb - i0));
    alignas(32) float d[8] = {}, dmin[8] = {};
    alignas(64) uint64_t mins[8] = {};
    __m512i acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < B; ++k) {
      for (int r = 0; r < R; ++r) acc[k * R + r] = _mm512_setzero_si512();
      if (k >= n) continue;
      const int64_t i = i0 + k;
      const uint8_t* b = w + i * bytes;
      prefetch_ahead(b, bytes);
      const Q45kRegs q = q45k_regs<Q5>(b);
      for (int r = 0; r < R; ++r) {
        d[k * R + r] = fp16(b);
        dmin[k * R + r] = fp16(b + 2);
        acc[k * R + r] = q45k_lanes_dot(q, xp + (i * 4 * R + r) * 64, R * 64);
      }
      mins[k] = q.mn;
    }
    const VI S = reduce8<8>(acc);
    const uint64_t live = n == B ? ~0ull : (1ull << (8 * n)) - 1;  // the i16 sums of the n blocks
    __m512i p[2];  // (half, row) pairs: R = 1: halves 0, 1; R = 2: rows 0, 1
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) {
        __m512i v = _mm512_madd_epi16(_mm512_cvtepu8_epi16(load(mins + 4 * h)),
                                      _mm512_maskz_loadu_epi16(static_cast<__mmask32>(live >> (32 * h)), s32h[r] + (i0 + 4 * h) * 8));
        v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0x4E)));
        p[h + r] = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0xB1)));
      }
    const VI Mn = _mm512_castsi512_si256(_mm512_permutex2var_epi32(p[0], gather, p[1]));
    const __mmask8 blocks = static_cast<__mmask8>((1u << n) - 1);
    VF dx;
    if constexpr (R == 1) {
      dx = _mm256_maskz_loadu_ps(blocks, dxr[0] + i0);
    } else {  // lane 2k + r: row r's block k
      dx = _mm256_permutex2var_ps(_mm256_maskz_loadu_ps(blocks, dxr[0] + i0), _mm256_set_epi32(11, 3, 10, 2, 9, 1, 8, 0),
                                  _mm256_maskz_loadu_ps(blocks, dxr[R - 1] + i0));
    }
    const VF m = _mm256_mul_ps(_mm256_cvtepi32_ps(Mn), _mm256_mul_ps(dx, _mm256_load_ps(dmin)));
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_fmsub_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dx, _mm256_load_ps(d)), m));
    for (int k = 0; k < n; ++k)
      for (int r = 0; r < R; ++r) f[r] += t[k * R + r];
  }
  for (int r = 0; r < R; ++r) out[r] = f[r];
}

// Q6_K with the quants in fixed lanes: 32-bit lane L of each of the 4 registers holds 4 quants of sub-block
// q6k_sub(L) (its values 4c..4c + 3 in register c). The low nibbles of 64 bytes of a half-block are 4
// whole sub-blocks, one per 128-bit lane, and so are their high nibbles; their 2 high bits come from the
// half's 32 high-bit bytes, broadcast to both 256-bit halves and shifted per 128-bit lane. A 4 x 4 transpose
// of 32-bit words within each 128-bit lane then puts word c of every sub-block in register c. The lanes
// accumulate over the 4 registers from -32 x the sub-block's activation sum (the offset), and one 32-bit
// multiply by the 16 scales gives S's lanes: per row, 4 u8 x s8 dot products and one multiply, where
// dot_q6k_zc needs 4 products to i16, 4 multiply-adds and the offset's 3 operations.
struct Q6kRegs {
  __m512i q[4];
  __m512i sc;  // i32 lane L: the scale of sub-block q6k_sub(L)
};
inline Q6kRegs q6k_regs(const uint8_t* b) {
  const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  // to bits 4-5: low nibbles take bits 0-1 (128-bit lanes 0, 1) or 2-3 (lanes 2, 3), high ones 4-5 or 6-7
  const __m512i up = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), down = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  __m512i x[4];  // 128-bit lane t of x[r]: sub-block 4 r + t
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h), hb = bcast256(load(b + 128 + 32 * h));
    x[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m0f), _mm512_and_si512(_mm512_sllv_epi64(hb, up), m30));
    x[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f),
                                   _mm512_and_si512(_mm512_srlv_epi64(hb, down), m30));
  }
  const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
  Q6kRegs r;
  r.q[0] = _mm512_unpacklo_epi64(t0, t2);
  r.q[1] = _mm512_unpackhi_epi64(t0, t2);
  r.q[2] = _mm512_unpacklo_epi64(t1, t3);
  r.q[3] = _mm512_unpackhi_epi64(t1, t3);
  const __m128i pick = _mm_set_epi8(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);  // byte L: q6k_sub(L)
  r.sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), pick));
  return r;
}
// S's 16 lanes for one row: x, the row's 4 registers of the block (`stride` bytes apart); o, its offsets
inline __m512i q6k_lanes_dot(const Q6kRegs& w, const int8_t* x, int64_t stride, const int32_t* o) {
  __m512i acc = _mm512_loadu_si512(o);
  for (int c = 0; c < 4; ++c) acc = _mm512_dpbusd_epi32(acc, w.q[c], _mm512_loadu_si512(x + c * stride));
  return _mm512_mullo_epi32(acc, w.sc);
}

// R = 2..12 rows side by side: a tree for (up to 8) rows' S, a vector fp32 step.
template <int R>
void dot_q6k_fl(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const int8_t* xp = a.q6perm(m0);
  const int32_t* op = a.o6group(m0);
  constexpr int R0 = R < 8 ? R : 8, R1 = R - R0;  // rows of the first and the second tree
  constexpr __mmask8 rows0 = static_cast<__mmask8>((1u << R0) - 1), rows1 = static_cast<__mmask8>((1u << R1) - 1);
  VF fr[2] = {fzero(), fzero()};
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * 210;
    prefetch_ahead(b, 210);
    const Q6kRegs q = q6k_regs(b);
    __m512i v[R];
    for (int r = 0; r < R; ++r) v[r] = q6k_lanes_dot(q, xp + (i * 4 * R + r) * 64, R * 64, op + (i * R + r) * 16);
    const float d = fp16(b + 208);
    auto step = [&](auto n, int h, __mmask8 rows) {  // rows 8h.. of the group, n of them
      const VI S = reduce8<decltype(n)::value>(v + 8 * h);
      const VF dx = _mm256_maskz_loadu_ps(rows, a.dT.data() + i * a.M + m0 + 8 * h);
      fr[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dx, _mm256_set1_ps(d)), fr[h]);
    };
    step(std::integral_constant<int, R0>{}, 0, rows0);
    if constexpr (R1 > 0) step(std::integral_constant<int, R1>{}, 1, rows1);
  }
  _mm256_mask_storeu_ps(out, rows0, fr[0]);
  if constexpr (R1 > 0) _mm256_mask_storeu_ps(out + 8, rows1, fr[1]);
}

// A row alone: 8 blocks' S through one tree, the fmas into f in block order (step6's operations).
void dot_q6k_fl1(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const int8_t* xp = a.q6perm(m0);
  const int32_t* op = a.o6group(m0);
  const float* dxr = a.drow(m0);
  float f = 0.f;
  for (int64_t i0 = 0; i0 < nb; i0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - i0));
    alignas(32) float d[8] = {};
    __m512i v[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      v[k] = _mm512_setzero_si512();
      if (k >= n) continue;
      const int64_t i = i0 + k;
      const uint8_t* b = w + i * 210;
      prefetch_ahead(b, 210);
      d[k] = fp16(b + 208);
      v[k] = q6k_lanes_dot(q6k_regs(b), xp + i * 256, 64, op + i * 16);
    }
    const VF dx = _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1), dxr + i0);
    alignas(32) float sf[8], dxd[8];
    _mm256_store_ps(sf, _mm256_cvtepi32_ps(reduce8<8>(v)));
    _mm256_store_ps(dxd, _mm256_mul_ps(dx, _mm256_load_ps(d)));
    for (int k = 0; k < n; ++k) f = std::fma(sf[k], dxd[k], f);
  }
  *out = f;
}

// 32-value blocks as signed bytes (the zmm build: Q5_0's fifth bit through a mask instead of a shuffle);
// the same bytes as q32_weights.
template <int64_t T>
inline VI q32_weights_z(const uint8_t* b) {
  if (T != kQ5_0) return q32_weights<T>(b);
  uint32_t high;
  std::memcpy(&high, b + 2, 4);
  const VI nib = nibbles16(b + 6);  // (nib | 16 * bit) - 16: nib where the bit is set, nib - 16 elsewhere
  return _mm256_mask_sub_epi8(nib, static_cast<__mmask32>(~high), nib, set8(16));
}

template <int R, int64_t T>
void dot_q32_z(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  constexpr int64_t bytes = T == kQ8_0 ? 34 : (T == kQ4_0 ? 18 : 22);
  __m512 f[R];  // lanes 0-7: even blocks, 8-15: odd blocks, each in block order
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  __m512i pick[4];  // fp32 lanes 0-7: block 2p's scale, 8-15: block 2p + 1's
  for (int p = 0; p < 4; ++p)
    pick[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  int64_t i = 0;
  for (; i + 8 <= nb; i += 8) {  // 8 blocks: their 8 scales converted at once, one product per row
    const uint8_t* b = w + i * bytes;
    prefetch_ahead(b, 8 * bytes);
    uint16_t h[8];
    for (int k = 0; k < 8; ++k) std::memcpy(h + k, b + k * bytes, 2);  // the fp16 scale leads each block
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    __m512i aq[4];
    __mmask64 neg[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q32_weights_z<T>(b + 2 * p * bytes)),
                                           q32_weights_z<T>(b + (2 * p + 1) * bytes), 1);
      aq[p] = _mm512_abs_epi8(q);
      neg[p] = _mm512_movepi8_mask(q);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s8 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(rw.d[r] + i), dw));  // dx * d
      for (int p = 0; p < 4; ++p) {
        const __m512i x = _mm512_loadu_si512(rw.q[r] + (i + 2 * p) * 32);
        const __m512i sx = _mm512_mask_sub_epi8(x, neg[p], _mm512_setzero_si512(), x);  // x * sign(q), q != 0
        const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq[p], sx);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_permutexvar_ps(pick[p], s8), f[r]);
      }
    }
  }
  for (; i + 2 <= nb; i += 2) {
    const uint8_t* b = w + i * bytes;
    prefetch_ahead(b, 2 * bytes);
    const float d0 = fp16(b), d1 = fp16(b + bytes);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q32_weights_z<T>(b)), q32_weights_z<T>(b + bytes), 1);
    const __m512i aq = _mm512_abs_epi8(q);
    const __mmask64 neg = _mm512_movepi8_mask(q);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(rw.q[r] + i * 32);
      const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
      const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq, sx);
      const float* dx = rw.d[r] + i;
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(dx[0] * d0), _mm256_set1_ps(dx[1] * d1), 1);
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), s, f[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    VF even = _mm512_castps512_ps256(f[r]);
    const VF odd = _mm512_extractf32x8_ps(f[r], 1);
    if (i < nb) {  // a last, even block
      const uint8_t* b = w + i * bytes;
      const VI q = q32_weights_z<T>(b);
      const VI l = dot4(abs8(q), sign8(load(rw.q[r] + i * 32), q));
      even = fmadd_i(l, rw.d[r][i] * fp16(b), even);
    }
    out[r] = hsum(fadd(even, odd));
  }
}
// A group of a 32-value type: more than 8 rows in two passes over the channel (in L1 for the second).
template <int R, int64_t T>
void dot_q32_zg(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  if constexpr (R <= 8) {
    dot_q32_z<R, T>(w, nb, a, m0, out);
  } else {
    dot_q32_z<8, T>(w, nb, a, m0, out);
    dot_q32_z<R - 8, T>(w, nb, a, m0 + 8, out + 8);
  }
}
#endif

// ---- Q4_K and Q6_K, 16 channels interleaved: the channels in the vector lanes -----------------------
// `repack_q4k_x16` lays out each block of 16 channels (rows of the weight) side by side, 2368 bytes where
// the file has 16 x 144: d and dmin of the 16 channels (fp16), the 8 six-bit scales unpacked to bytes
// (sc[j][c]), the 8 mins likewise as 4-byte groups (mn[j / 4][c][j % 4]), then the quants: 32 registers of
// 64 bytes whose byte 4c + t holds channel c's value 4u + t (register u) in its low nibble and value 128 +
// 4u + t in its high one. A u8 x s8 dot product of a register's nibbles with 4 activations broadcast adds
// 4 products into each of the 16 channels' lanes at once: no horizontal sums, no tree, and the fp32 steps
// run on 16 channels at once. S and Mn are the exact integers of the other kernels, and the steps are
// step45's lane by lane: the same bits.
constexpr int64_t kX16Bytes = 2368, kX16Dmin = 32, kX16Sc = 64, kX16Mn = 192, kX16Qs = 320;
// Each line of a block is asked for 32 KiB ahead into L2 (prefetcht2): this kernel consumes its stream about
// 2.5x as fast as the file-order ones, and asking into L1 4 KiB ahead left it waiting on memory (from a
// 116 MB matrix, one thread: 18.1 ns a block, 8.0 ns so; two threads 9.5 and 5.4 ns, about what a plain
// read of memory reached that hour)
constexpr int64_t kX16Ahead = 32768;

// A layout of 16 channels side by side: `fill(o, c, b)` writes channel c's share of an output block o from
// its file block b (`in` bytes), for every block of every 16 channels.
template <typename Fill>
at::Tensor repack_x16(const at::Tensor& w, const char* type, int64_t in, int64_t out_bytes, Fill fill) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "repack_x16: uint8 [N, row_bytes] blocks");
  const int64_t N = w.size(0), row = w.size(1), nb = row / in;
  TORCH_CHECK(N % 16 == 0 && row % in == 0, "repack_x16: N must be a multiple of 16 and rows whole ", type, " blocks");
  auto out = at::empty({N / 16, nb * out_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i = 0; i < nb; ++i)
        for (int c = 0; c < 16; ++c) fill(dst + (g * nb + i) * out_bytes, c, src + (g * 16 + c) * row + i * in);
  });
  return out;
}

at::Tensor repack_q4k_x16(at::Tensor w) {
  return repack_x16(w, "Q4_K", 144, kX16Bytes, [](uint8_t* o, int c, const uint8_t* b) {
    std::memcpy(o + 2 * c, b, 2);
    std::memcpy(o + kX16Dmin + 2 * c, b + 2, 2);
    uint64_t sc, mn;
    k_scales_mins(b + 4, &sc, &mn);
    for (int j = 0; j < 8; ++j) {
      o[kX16Sc + 16 * j + c] = byte_of(sc, j);
      o[kX16Mn + 64 * (j / 4) + 4 * c + j % 4] = byte_of(mn, j);
    }
    // register u < 8: values 4u.. of the file's chunks 0 (low nibbles) and 2; u < 16: their high nibbles
    // (values 32 + ..); u < 24, u < 32: likewise from chunks 1 and 3
    const uint8_t* qs = b + 16;
    for (int u = 0; u < 32; ++u) {  // 4 values at a time
      uint32_t lo, hi;
      std::memcpy(&lo, qs + 32 * (u / 16) + 4 * (u % 8), 4);
      std::memcpy(&hi, qs + 64 + 32 * (u / 16) + 4 * (u % 8), 4);
      const uint32_t v = (u % 16) < 8 ? (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4)
                                      : ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
      std::memcpy(o + kX16Qs + 64 * u + 4 * c, &v, 4);
    }
  });
}

// R rows x 16 channels; out[16 r + c]. The portable form (every build): the integers, then step45.
template <int R>
void dot_q4kx16_scalar(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 16; ++c) {
      const int8_t* x = a.qrow(m0 + r);
      float f = 0.f;
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * kX16Bytes;
        int32_t S = 0, Mn = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t A = 0;
          for (int v = 32 * j; v < 32 * j + 32; ++v) {
            const int u = (v % 128) / 4, t = v % 4;
            A += ((b[kX16Qs + 64 * u + 4 * c + t] >> (v < 128 ? 0 : 4)) & 0xF) * x[i * 256 + v];
          }
          S += b[kX16Sc + 16 * j + c] * A;
          Mn += b[kX16Mn + 64 * (j / 4) + 4 * c + j % 4] * a.s32row(m0 + r)[i * 8 + j];
        }
        f = step45(f, S, Mn, a.drow(m0 + r)[i], fp16(b + 2 * c), fp16(b + kX16Dmin + 2 * c));
      }
      out[16 * r + c] = f;
    }
}

#if defined(SPECDEC_Z512)
inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// J sub-blocks (j0.., and j0 + 4..) of R rows at a time: 2 J R accumulators of 8 chained dot products each
template <int R>
void dot_q4kx16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R >= 1 && R <= 4, "one to four rows");
  constexpr int J = R <= 2 ? 4 : 2;
  const __m512i m4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
  const Rows<R> rw(a, m0);
  const int8_t* const* x = rw.q;
  const uint8_t* const* lo = rw.lo;
  const int8_t* const* hi = rw.hi;
  const float* const* dx = rw.d;
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * kX16Bytes;
    for (int64_t l = 0; l < kX16Qs; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
    __m512i S[R];
    for (int r = 0; r < R; ++r) S[r] = z;
    for (int j0 = 0; j0 < 4; j0 += J) {
      __m512i al[J][R], ah[J][R];  // sub-blocks j0 + jj and j0 + jj + 4
      for (int jj = 0; jj < J; ++jj)
        for (int r = 0; r < R; ++r) al[jj][r] = ah[jj][r] = z;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k)
        for (int jj = 0; jj < J; ++jj) {
          const int u = 8 * (j0 + jj) + k;
          __builtin_prefetch(b + kX16Ahead + kX16Qs + 64 * u, 0, 1);
          const __m512i P = _mm512_loadu_si512(b + kX16Qs + 64 * u);
          const __m512i ql = _mm512_and_si512(P, m4), qh = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
          for (int r = 0; r < R; ++r) {
            al[jj][r] = _mm512_dpbusd_epi32(al[jj][r], ql, bcast32(x[r] + i * 256 + 4 * u));
            ah[jj][r] = _mm512_dpbusd_epi32(ah[jj][r], qh, bcast32(x[r] + i * 256 + 128 + 4 * u));
          }
        }
      for (int jj = 0; jj < J; ++jj) {
        const int j = j0 + jj;
        const __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kX16Sc + 16 * j)));
        const __m512i sh = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kX16Sc + 16 * (j + 4))));
        for (int r = 0; r < R; ++r)
          S[r] = _mm512_add_epi32(S[r], _mm512_add_epi32(_mm512_mullo_epi32(al[jj][r], sl), _mm512_mullo_epi32(ah[jj][r], sh)));
      }
    }
    const __m512i mn0 = _mm512_loadu_si512(b + kX16Mn), mn1 = _mm512_loadu_si512(b + kX16Mn + 64);
    const __m512 dv = _mm512_cvtph_ps(load(b)), dmv = _mm512_cvtph_ps(load(b + kX16Dmin));
    for (int r = 0; r < R; ++r) {
      // Mn: the mins (u8, < 64) times the row's sums of 32 quants as low byte + 256 x high byte
      const __m512i ml = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, bcast32(lo[r] + i * 8), mn0), bcast32(lo[r] + i * 8 + 4), mn1);
      const __m512i mh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, mn0, bcast32(hi[r] + i * 8)), mn1, bcast32(hi[r] + i * 8 + 4));
      const __m512i Mn = _mm512_add_epi32(ml, _mm512_slli_epi32(mh, 8));
      const __m512 d = _mm512_set1_ps(dx[r][i]);
      const __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(d, dmv));
      f[r] = _mm512_add_ps(f[r], _mm512_fmsub_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(d, dv), m));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, f[r]);
}
#endif

// Q6_K, 16 channels side by side (`repack_q6k_x16`), 3360 bytes as in the file: d of the 16 channels (fp16),
// the 16 signed scales (sc[j][c]), the low 4 bits of the quants as Q4_K's 32 registers (low nibble: value
// 4u + t, high nibble: 128 + 4u + t, in byte 4c + t of register u), then their high 2 bits in 16 registers:
// byte 4c + t of register h holds those of values 4h + t, 128 + 4h + t, 64 + 4h + t and 192 + 4h + t (bits
// 0-1, 2-3, 4-5, 6-7). The lanes of a 16-value sub-block start from -32 x the row's sum of its 16 quants
// (Q6_K's offset), then S = the sum of scale x lane: the exact integer of the other kernels; step6.
constexpr int64_t kX16Q6Bytes = 3360, kX16Q6Sc = 32, kX16Q6Lo = 288, kX16Q6Hi = 2336;

at::Tensor repack_q6k_x16(at::Tensor w) {
  return repack_x16(w, "Q6_K", 210, kX16Q6Bytes, [](uint8_t* o, int c, const uint8_t* b) {
    std::memcpy(o + 2 * c, b + 208, 2);
    for (int j = 0; j < 16; ++j) o[kX16Q6Sc + 16 * j + c] = b[192 + j];
    uint8_t q[256];  // the quants in value order (0..63, before the -32), 32 at a time
    for (int n = 0; n < 2; ++n)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = b[64 * n + l], c2 = b[64 * n + l + 32], h = b[128 + 32 * n + l];
        q[128 * n + l] = static_cast<uint8_t>((a & 0xF) | ((h & 3) << 4));
        q[128 * n + l + 32] = static_cast<uint8_t>((c2 & 0xF) | (((h >> 2) & 3) << 4));
        q[128 * n + l + 64] = static_cast<uint8_t>((a >> 4) | (((h >> 4) & 3) << 4));
        q[128 * n + l + 96] = static_cast<uint8_t>((c2 >> 4) | (((h >> 6) & 3) << 4));
      }
    auto word = [&q](int v) { uint32_t x; std::memcpy(&x, q + v, 4); return x; };  // values v..v + 3
    for (int u = 0; u < 32; ++u) {
      const uint32_t v = (word(4 * u) & 0x0F0F0F0Fu) | ((word(128 + 4 * u) & 0x0F0F0F0Fu) << 4);
      std::memcpy(o + kX16Q6Lo + 64 * u + 4 * c, &v, 4);
    }
    for (int h = 0; h < 16; ++h) {
      auto top = [&word](int v) { return (word(v) >> 4) & 0x03030303u; };
      const uint32_t v = top(4 * h) | (top(128 + 4 * h) << 2) | (top(64 + 4 * h) << 4) | (top(192 + 4 * h) << 6);
      std::memcpy(o + kX16Q6Hi + 64 * h + 4 * c, &v, 4);
    }
  });
}

inline int q6kx16_value(const uint8_t* b, int c, int v) {  // quant v of channel c in a block of 16 channels
  const int u = (v % 128) / 4, t = v % 4, h = u % 16;
  const int low = (b[kX16Q6Lo + 64 * u + 4 * c + t] >> (v < 128 ? 0 : 4)) & 0xF;
  const int shift = 2 * ((v >= 128 ? 1 : 0) + 2 * (u / 16));
  return low | (((b[kX16Q6Hi + 64 * h + 4 * c + t] >> shift) & 3) << 4);
}

template <int R>
void dot_q6kx16_scalar(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 16; ++c) {
      const int8_t* x = a.qrow(m0 + r);
      float f = 0.f;
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * kX16Q6Bytes;
        int32_t S = 0;
        for (int j = 0; j < 16; ++j) {
          int32_t A = 0;
          for (int v = 16 * j; v < 16 * j + 16; ++v) A += (q6kx16_value(b, c, v) - 32) * x[i * 256 + v];
          S += static_cast<int8_t>(b[kX16Q6Sc + 16 * j + c]) * A;
        }
        f = step6(f, S, a.drow(m0 + r)[i], fp16(b + 2 * c));
      }
      out[16 * r + c] = f;
    }
}

#if defined(SPECDEC_Z512)
// J pairs of sub-blocks (j, j + 8) of R rows at a time: 2 J R accumulators of 4 chained dot products each
template <int R>
void dot_q6kx16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R >= 1 && R <= 4, "one to four rows");
  constexpr int J = R <= 2 ? 4 : 2;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const Rows<R> rw(a, m0);
  const int8_t* const* x = rw.q;
  const int16_t* const* s16 = rw.s;
  const float* const* dx = rw.d;
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * kX16Q6Bytes;
    for (int64_t l = 0; l < kX16Q6Lo; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
    __m512i S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm512_setzero_si512();
    for (int j0 = 0; j0 < 8; j0 += J) {
      __m512i al[J][R], ah[J][R];  // sub-blocks j0 + jj and j0 + jj + 8, from the offsets
      for (int jj = 0; jj < J; ++jj)
        for (int r = 0; r < R; ++r) {
          al[jj][r] = _mm512_set1_epi32(-32 * s16[r][i * 16 + j0 + jj]);
          ah[jj][r] = _mm512_set1_epi32(-32 * s16[r][i * 16 + j0 + jj + 8]);
        }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k)
        for (int jj = 0; jj < J; ++jj) {
          const int u = 4 * (j0 + jj) + k;
          __builtin_prefetch(b + kX16Ahead + kX16Q6Lo + 64 * u, 0, 1);
          if (u < 16) __builtin_prefetch(b + kX16Ahead + kX16Q6Hi + 64 * u, 0, 1);
          const __m512i P = _mm512_loadu_si512(b + kX16Q6Lo + 64 * u);
          const __m512i H = _mm512_srli_epi16(_mm512_loadu_si512(b + kX16Q6Hi + 64 * (u % 16)), 4 * (u / 16));
          const __m512i ql = _mm512_or_si512(_mm512_and_si512(P, m4), _mm512_and_si512(_mm512_slli_epi16(H, 4), m30));
          const __m512i qh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(P, 4), m4), _mm512_and_si512(_mm512_slli_epi16(H, 2), m30));
          for (int r = 0; r < R; ++r) {
            al[jj][r] = _mm512_dpbusd_epi32(al[jj][r], ql, bcast32(x[r] + i * 256 + 4 * u));
            ah[jj][r] = _mm512_dpbusd_epi32(ah[jj][r], qh, bcast32(x[r] + i * 256 + 128 + 4 * u));
          }
        }
      for (int jj = 0; jj < J; ++jj) {
        const int j = j0 + jj;
        const __m512i sl = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kX16Q6Sc + 16 * j)));
        const __m512i sh = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kX16Q6Sc + 16 * (j + 8))));
        for (int r = 0; r < R; ++r)
          S[r] = _mm512_add_epi32(S[r], _mm512_add_epi32(_mm512_mullo_epi32(al[jj][r], sl), _mm512_mullo_epi32(ah[jj][r], sh)));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(load(b));
    for (int r = 0; r < R; ++r) f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(_mm512_set1_ps(dx[r][i]), dv), f[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, f[r]);
}
#endif

// Q4_0 / Q5_0, 16 channels side by side (`repack_q40_x16`, `repack_q50_x16`), as many bytes as the file's 16
// blocks: d of the 16 channels (fp16), then 4 registers of 64 bytes whose byte 4c + t is the file's quant
// byte 4u + t of channel c (register u: value 4u + t in the low nibble, 16 + 4u + t in the high one), then
// for Q5_0 the fifth bits as 8 masks of 64 bits (mask l: bit 4c + t is that of channel c's value 4l + t).
// A u8 x s8 dot product of a register's nibbles (and fifth bits) with 4 broadcast activations, started
// from -8 (Q4_0) or -16 (Q5_0) x their sum, is lane l's integer of the file-layout kernels (`dot4`: values
// 4l..4l + 3) for 16 channels at once; each lane then takes the fp32 steps of those kernels in their order
// (even and odd blocks on two chains, lane by lane), and `hsum`'s tree closes each channel: the same bits.
constexpr int64_t kX16Q40Bytes = 288, kX16Q50Bytes = 352, kX16Q32Qs = 32, kX16Q5Hi = 288;

template <bool Q5>
at::Tensor repack_q32_x16(const at::Tensor& w) {
  constexpr int64_t in = Q5 ? 22 : 18, qs = Q5 ? 6 : 2;
  constexpr int64_t out = Q5 ? kX16Q50Bytes : kX16Q40Bytes;
  return repack_x16(w, Q5 ? "Q5_0" : "Q4_0", in, out, [](uint8_t* o, int c, const uint8_t* b) {
    std::memcpy(o + 2 * c, b, 2);
    for (int u = 0; u < 4; ++u) std::memcpy(o + kX16Q32Qs + 64 * u + 4 * c, b + qs + 4 * u, 4);
    if (Q5) {
      uint32_t high;
      std::memcpy(&high, b + 2, 4);
      for (int l = 0; l < 8; ++l) {  // 4 bits of channel c in byte c / 2 of mask l
        uint8_t& m = o[kX16Q5Hi + 8 * l + c / 2];
        m = static_cast<uint8_t>((c % 2 ? m & 0x0F : 0) | (((high >> (4 * l)) & 0xF) << (4 * (c % 2))));
      }
    }
  });
}
at::Tensor repack_q40_x16(at::Tensor w) { return repack_q32_x16<false>(w); }
at::Tensor repack_q50_x16(at::Tensor w) { return repack_q32_x16<true>(w); }

template <bool Q5>
inline int q32x16_value(const uint8_t* b, int c, int v) {  // weight v (0..31) of channel c, after the offset
  const int u = (v % 16) / 4, t = v % 4;
  const int nib = (b[kX16Q32Qs + 64 * u + 4 * c + t] >> (v < 16 ? 0 : 4)) & 0xF;
  if (!Q5) return nib - 8;
  const int bit = (b[kX16Q5Hi + 8 * (v / 4) + c / 2] >> (4 * (c % 2) + t)) & 1;
  return (nib | (bit << 4)) - 16;
}

// R rows x 16 channels; out[16 r + c]. The portable form (every build): lane integers, then the steps.
template <int R, bool Q5>
void dot_q32x16_scalar(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  constexpr int64_t bytes = Q5 ? kX16Q50Bytes : kX16Q40Bytes;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 16; ++c) {
      const int8_t* x = a.qrow(m0 + r);
      float f[2][8] = {};
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * bytes;
        const float s = a.drow(m0 + r)[i] * fp16(b + 2 * c);
        for (int l = 0; l < 8; ++l) {
          int32_t L = 0;
          for (int v = 4 * l; v < 4 * l + 4; ++v) L += q32x16_value<Q5>(b, c, v) * x[i * 32 + v];
          f[i & 1][l] = std::fma(static_cast<float>(L), s, f[i & 1][l]);
        }
      }
      float t[8];
      for (int l = 0; l < 8; ++l) t[l] = f[0][l] + f[1][l];
      out[16 * r + c] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    }
}

#if defined(SPECDEC_Z512)
// One row at a time over the whole column of 16 channels (a few KiB: in L1 for the next rows), its 16
// accumulators (8 lanes x 2 chains) in registers.
template <int R, bool Q5>
void dot_q32x16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  constexpr int64_t bytes = Q5 ? kX16Q50Bytes : kX16Q40Bytes;
  constexpr int32_t offset = Q5 ? -16 : -8;
  const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.qrow(m0 + r);
    const float* dx = a.drow(m0 + r);
    __m512 f[2][8];
    for (int p = 0; p < 2; ++p)
      for (int l = 0; l < 8; ++l) f[p][l] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * bytes;
      if (r == 0)
        for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(dx[i]), _mm512_cvtph_ps(load(b)));  // dx * d
      // lane l's start: offset x the sum of the row's values 4l..4l + 3
      alignas(32) int32_t start[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(start),
                         _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, load(x + i * 32)),
                                            _mm256_set1_epi32(offset)));
      __m512* fi = f[i & 1];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i P = _mm512_loadu_si512(b + kX16Q32Qs + 64 * u);
        __m512i ql = _mm512_and_si512(P, m4), qh = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
        if (Q5) {
          uint64_t hl, hh;
          std::memcpy(&hl, b + kX16Q5Hi + 8 * u, 8);
          std::memcpy(&hh, b + kX16Q5Hi + 8 * (u + 4), 8);
          ql = _mm512_mask_add_epi8(ql, hl, ql, b16);  // the fifth bit: + 16 where set
          qh = _mm512_mask_add_epi8(qh, hh, qh, b16);
        }
        const __m512i lo = _mm512_dpbusd_epi32(_mm512_set1_epi32(start[u]), ql, bcast32(x + i * 32 + 4 * u));
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_set1_epi32(start[u + 4]), qh, bcast32(x + i * 32 + 16 + 4 * u));
        fi[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, fi[u]);
        fi[u + 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, fi[u + 4]);
      }
    }
    __m512 t[8];
    for (int l = 0; l < 8; ++l) t[l] = _mm512_add_ps(f[0][l], f[1][l]);
    _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[4]), _mm512_add_ps(t[2], t[6])),
                                                 _mm512_add_ps(_mm512_add_ps(t[1], t[5]), _mm512_add_ps(t[3], t[7]))));
  }
}
#endif

using X16Fn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, float*);
template <int R>
X16Fn x16_for(int64_t type) {
#if defined(SPECDEC_Z512)
  switch (type) {
    case kQ4_KX16: return &dot_q4kx16<R>;
    case kQ6_KX16: return &dot_q6kx16<R>;
    case kQ4_0X16: return &dot_q32x16<R, false>;
    default: return &dot_q32x16<R, true>;
  }
#else
  switch (type) {
    case kQ4_KX16: return &dot_q4kx16_scalar<R>;
    case kQ6_KX16: return &dot_q6kx16_scalar<R>;
    case kQ4_0X16: return &dot_q32x16_scalar<R, false>;
    default: return &dot_q32x16_scalar<R, true>;
  }
#endif
}
X16Fn x16_fn(int64_t type, int rows) {
  switch (rows) {
    case 1: return x16_for<1>(type);
    case 2: return x16_for<2>(type);
    case 3: return x16_for<3>(type);
    default: return x16_for<4>(type);
  }
}

using DotFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, float*);

template <int R>
DotFn dot_for(int64_t type) {
#if defined(SPECDEC_Z512)
  switch (type) {  // the k-quants of a row alone: its blocks side by side
    case kQ4_K: if constexpr (R <= 2) return &dot_q45k_flb<R, false>; else return &dot_q45k_fl<R, false>;
    case kQ5_K: if constexpr (R <= 2) return &dot_q45k_flb<R, true>; else return &dot_q45k_fl<R, true>;
    case kQ6_K: if constexpr (R == 1) return &dot_q6k_fl1; else return &dot_q6k_fl<R>;
    case kQ8_0: return &dot_q32_zg<R, kQ8_0>;
    case kQ4_0: return &dot_q32_zg<R, kQ4_0>;
    case kQ5_0: return &dot_q32_zg<R, kQ5_0>;
  }
#endif
  switch (type) {
    case kQ4_K: return &dot_q45k<R, false>;
    case kQ5_K: return &dot_q45k<R, true>;
    case kQ6_K: return &dot_q6k<R>;
    case kQ8_0: return &dot_q32<R, kQ8_0>;
    case kQ4_0: return &dot_q32<R, kQ4_0>;
    case kQ5_0: return &dot_q32<R, kQ5_0>;
  }
  return nullptr;
}

DotFn dot_fn(int64_t type, int rows) {
  switch (rows) {
    case 1: return dot_for<1>(type);
    case 2: return dot_for<2>(type);
    case 3: return dot_for<3>(type);
    case 4: return dot_for<4>(type);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case 5: return dot_for<5>(type);
    case 6: return dot_for<6>(type);
    case 7: return dot_for<7>(type);
    case 8: return dot_for<8>(type);
    case 9: return dot_for<9>(type);
    case 10: return dot_for<10>(type);
    case 11: return dot_for<11>(type);
    case 12: return dot_for<12>(type);
#endif
  }
  return nullptr;
}

// Two channels at a time, for one or two rows (nullptr: not offered for this type / build, or not chosen).
// Which of the two row counts take them is the process's choice (`set_pair_rows`, bit r - 1 for r rows):
// they give the bits of the one-channel kernels, and which is faster depends on the core (measured: on
// Sapphire Rapids the two streams hide latencies for one or two rows; on Zen 4 the one-channel kernel is
// faster, the two-row pair costing about what 4 rows do in one channel).
std::atomic<int> g_pair_rows{3};
void set_pair_rows(int64_t mask) { g_pair_rows.store(static_cast<int>(mask & 3)); }
int64_t pair_rows() { return g_pair_rows.load(); }

using Dot2Fn = void (*)(const uint8_t* const*, int64_t, const Acts&, int64_t, float*);
Dot2Fn dot2_fn(int64_t type, int rows) {
#if defined(SPECDEC_Z512)
  if ((rows == 1 || rows == 2) && (g_pair_rows.load(std::memory_order_relaxed) >> (rows - 1) & 1)) {
    switch (type) {
      case kQ4_K: return rows == 1 ? &dot_q45k_zc<1, 2, false> : &dot_q45k_zc<2, 2, false>;
      case kQ5_K: return rows == 1 ? &dot_q45k_zc<1, 2, true> : &dot_q45k_zc<2, 2, true>;
      case kQ6_K: return rows == 1 ? &dot_q6k_zc<1, 2> : &dot_q6k_zc<2, 2>;
    }
  }
#endif
  (void)type;
  (void)rows;
  return nullptr;
}

bool is_k_quant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K || is_x16_k(t); }

int64_t block_bytes(int64_t t) {
  switch (t) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kQ4_KX16: return kX16Bytes;  // a block of 16 channels
    case kQ6_KX16: return kX16Q6Bytes;
    case kQ4_0X16: return kX16Q40Bytes;
    case kQ5_0X16: return kX16Q50Bytes;
  }
  return 0;
}

#if defined(SPECDEC_AMX)
// ---- AMX tiles (Sapphire Rapids and later) for the k-quants, many rows at once ------------------------
// The tile unit multiplies 16 x 64 bytes by 64 x 16 bytes into 16 x 16 int32 in one instruction. A block's
// integers are plain sums over its 256 positions, so each 64-position chunk of 16 channels is one tile row
// per channel: scale x weight (Q6_K: scale x (weight - 32)) as its low bytes and its high bytes (two
// products; the second sum counts 256 times), and for Q4_K / Q5_K the min of each position (a third
// product: Mn). The activations' tile holds 16 rows in the unit's layout (4 bytes of each row in turn).
// The fp32 steps then run over the 16 rows at once, lane by lane the operations of step45 / step6.
#ifndef SPECDEC_AMX_MIN_ROWS
#define SPECDEC_AMX_MIN_ROWS 12
#endif
constexpr int kAmxMinRows = SPECDEC_AMX_MIN_ROWS;
#ifndef EXP_UNPACK
#define EXP_UNPACK 1
#endif
#ifndef EXP_TMUL
#define EXP_TMUL 1
#endif
#ifndef EXP_SAMEBLOCK
#define EXP_SAMEBLOCK 0
#endif
#ifndef EXP_EPI
#define EXP_EPI 1
#endif

bool amx_ok() {
  // the kernel lets a process use the tile registers once it asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 / tmm1: sums of the low / high bytes (16 channels x 16 rows of int32); tmm4 / tmm5: their weight rows
// (16 channels x 64 bytes); tmm6: activations (16 x (16 rows x 4 bytes))
void amx_configure() {
  TileConfig c;
  for (int t : {0, 1, 4, 5, 6}) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// The activations in the tiles' layout, per group of 16 rows (missing rows are zeros), block and chunk of 64
// positions: byte 64 k4 + 4 n + t of a chunk's 1024 is row n's value at position 4 k4 + t of the chunk.
struct AmxActs {
  int64_t nb = 0;
  std::vector<int8_t> b;    // [g][i][chunk][1024]
  std::vector<float> d;     // [g][i][16 rows]: block scales (0 for missing rows)
  std::vector<int32_t> bs;  // [g][i][t][16 rows]: sums of sub-blocks 2t, 2t + 1 as an i16 pair (for Mn)
};

void amx_acts(const Acts& a, int64_t M, AmxActs& t) {
  const int64_t nb = a.K / 256, G = (M + 15) / 16;
  t.nb = nb;
  t.b.assign(G * nb * 4096, 0);
  t.d.assign(G * nb * 16, 0.f);
  t.bs.assign(G * nb * 64, 0);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / 16, n = m % 16;
    const int8_t* q = a.qrow(m);
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t gi = g * nb + i;
      t.d[gi * 16 + n] = a.drow(m)[i];
      int8_t* dst = t.b.data() + gi * 4096 + 4 * n;
      for (int64_t k4 = 0; k4 < 64; ++k4) std::memcpy(dst + (k4 / 16) * 1024 + (k4 % 16) * 64, q + i * 256 + 4 * k4, 4);
      const int32_t* s32 = a.s32row(m) + i * 8;
      for (int p = 0; p < 4; ++p)
        t.bs[(gi * 4 + p) * 16 + n] = pack_i16x2(s32[2 * p], s32[2 * p + 1]);
    }
  }
}

// Which scale each byte of a Q6_K chunk takes (built once): group 4j + p / 16.
struct AmxIdx {
  __m512i k6[4];
  AmxIdx() {
    alignas(64) int8_t v[64];
    for (int j = 0; j < 4; ++j) {
      for (int p = 0; p < 64; ++p) v[p] = static_cast<int8_t>(4 * j + p / 16);
      k6[j] = _mm512_load_si512(v);
    }
  }
};

// Q4_K / Q5_K: scale x weight for each 6-bit scale and 5-bit weight, as its low and its high byte (4 KB).
struct AmxScaled {
  alignas(64) uint8_t lo[64][32], hi[64][32];
  AmxScaled() {
    for (int sc = 0; sc < 64; ++sc)
      for (int q = 0; q < 32; ++q) {
        lo[sc][q] = static_cast<uint8_t>((sc * q) & 0xFF);
        hi[sc][q] = static_cast<uint8_t>((sc * q) >> 8);
      }
  }
};

constexpr int64_t kAmxChunk = 2 * 1024;  // a chunk's weight rows: low bytes, high bytes; 16 channels x 64

// 64 weights q (unsigned bytes) times their positions' scales (picked from the bytes of sv by idx), as words,
// stored as the row of their low bytes and the row of their high bytes; minus 32 x scale (Q6_K's offset).
inline void amx_scaled_rows_q6(__m512i q, __m512i sv, __m512i idx, uint8_t* lo, uint8_t* hi) {
  constexpr __mmask64 even = 0x5555555555555555ULL, odd = 0xAAAAAAAAAAAAAAAAULL;
  const __m512i se = _mm512_maskz_permutexvar_epi8(even, idx, sv), so = _mm512_maskz_permutexvar_epi8(odd, idx, sv);
  const __m512i k32 = _mm512_set1_epi8(32);
  // word t: (w(2t) - 32) sc, (w(2t + 1) - 32) sc
  const __m512i e = _mm512_sub_epi16(_mm512_maddubs_epi16(q, se), _mm512_maddubs_epi16(k32, se));
  const __m512i o = _mm512_sub_epi16(_mm512_maddubs_epi16(q, so), _mm512_maddubs_epi16(k32, so));
  // low bytes (e & 0xff) | (o << 8), high bytes (e >> 8) | (o & 0xff00): ternary logic 0xEA is (A & B) | C
  _mm512_store_si512(lo, _mm512_ternarylogic_epi32(e, _mm512_set1_epi16(0x00FF), _mm512_slli_epi16(o, 8), 0xEA));
  _mm512_store_si512(hi, _mm512_ternarylogic_epi32(o, _mm512_set1_epi16(static_cast<int16_t>(0xFF00)),
                                                   _mm512_srli_epi16(e, 8), 0xEA));
}

// One channel's block -> its rows of the 4 chunks (at rows + j * kAmxChunk), its scales and its mins (as the
// i16 pairs of sub-blocks 2t, 2t + 1). Scale x weight comes from AmxScaled: one byte permutation picks, for
// the 64 positions of a chunk, from the rows of its two sub-blocks' scales.
template <bool Q5>
inline void amx_weights_k45(const uint8_t* b, uint8_t* rows, float* d, float* dmin, int32_t* mins) {
  static const AmxScaled lut;
  *d = fp16(b);
  *dmin = fp16(b + 2);
  uint64_t sc, mn;
  k_scales_mins(b + 4, &sc, &mn);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(mins), _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn))));
  const uint8_t* qs = b + (Q5 ? 48 : 16);
  const __m512i m0f = _mm512_set1_epi8(0x0F), sh04 = shifts(0, 4);
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi8(0x40), 1);  // index of table b
  const __m512i hb = Q5 ? bcast256(load(b + 16)) : _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    // byte p: position 64 j + p (low nibbles of 32 bytes, then their high nibbles), plus 64 from p = 32 on
    __m512i hi5 = second;
    if (Q5) hi5 = _mm512_or_si512(hi5, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, shifts(2 * j, 2 * j + 1)), _mm512_set1_epi8(1)), 4));
    const __m512i q = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(bcast256(load(qs + 32 * j)), sh04), m0f, hi5, 0xEA);
    const int s0 = byte_of(sc, 2 * j), s1 = byte_of(sc, 2 * j + 1);
    uint8_t* at = rows + j * kAmxChunk;
    _mm512_store_si512(at, _mm512_permutex2var_epi8(_mm512_castsi256_si512(load(lut.lo[s0])), q, _mm512_castsi256_si512(load(lut.lo[s1]))));
    _mm512_store_si512(at + 1024, _mm512_permutex2var_epi8(_mm512_castsi256_si512(load(lut.hi[s0])), q, _mm512_castsi256_si512(load(lut.hi[s1]))));
  }
}

inline void amx_weights_q6k(const uint8_t* b, const AmxIdx& x, uint8_t* rows, float* d) {
  *d = fp16(b + 208);
  const __m512i sv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m512i m0f = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
  const __m512i sh02 = shifts(0, 2), sh46 = shifts(4, 6);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h);  // low nibbles: positions 128 h + [0, 64), high: + 64
    const __m512i hb = bcast256(load(b + 128 + 32 * h));
    const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l, m0f),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh02), m3), 4));
    const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh46), m3), 4));
    uint8_t* at = rows + 2 * h * kAmxChunk;
    amx_scaled_rows_q6(q0, sv, x.k6[2 * h], at, at + 1024);
    amx_scaled_rows_q6(q1, sv, x.k6[2 * h + 1], at + kAmxChunk, at + kAmxChunk + 1024);
  }
}

// Block i of 16 channels (rows of w) -> the tiles' weight rows A, d, dmin and mins[channel][4]. The weights are
// read block by block across the 16 rows, so reading ahead in address order would not reach them in time:
// instead each block's unpacking asks for its share (1 / nb) of the next 16 channels' rows, into L2.
template <int64_t T>
inline void amx_unpack(const uint8_t* w, int64_t row_bytes, int64_t i, const AmxIdx& x, uint8_t* A, float* d,
                       float* dmin, int32_t* mins) {
  const uint8_t* next = w + 16 * row_bytes + i * 16 * block_bytes(T);
  for (int64_t l = 0; l < 16 * block_bytes(T); l += 64) __builtin_prefetch(next + l, 0, 2);
  for (int c = 0; c < 16; ++c) {
    const uint8_t* b = w + c * row_bytes + i * block_bytes(T);
    if (T == kQ6_K) amx_weights_q6k(b, x, A + 64 * c, &d[c]);
    else amx_weights_k45<T == kQ5_K>(b, A + 64 * c, &d[c], &dmin[c], mins + 4 * c);
  }
}

// Channels [0, nch) (a multiple of 16) of weight rows w, all M rows: out(m0, rows, c0, v) gives the values of
// rows m0.. (rows of them) x channels c0..c0 + 15 as v[16 x channel + row]. Per 16 channels, a pipeline over
// the (block, row group) items: the products of an item are issued and their sums stored, then the item
// before is stepped and the block two ahead unpacked, so that neither the tile loads nor the fp32 steps wait
// on stores just made (a tile load cannot take bytes from stores in flight, nor a vector load from a tile
// store). Mn (Q4_K / Q5_K) is computed with the fp32 steps, from the rows' sub-block sums.
template <int64_t T, typename Out>
void amx_channels(const uint8_t* w, int64_t row_bytes, int64_t nch, const AmxActs& aa, int64_t M, Out&& out) {
  static const AmxIdx x;
  constexpr bool q6 = T == kQ6_K;
  const int64_t nb = aa.nb, G = (M + 15) / 16, items = nb * G;
  alignas(64) uint8_t A[3][4 * kAmxChunk];  // [block mod 3][chunk][low, high][16 channels][64]
  alignas(64) int32_t C[2][2][256];         // [item parity][low, high][16 channels][16 rows]
  alignas(64) float d[3][16], dmin[3][16];
  alignas(64) int32_t mins[3][64];          // [block mod 3][channel][4 pairs]
  std::vector<__m512> F(G * 16);
  auto step = [&](int64_t t) {  // the fp32 steps of item t = (block i, group g), from its stored sums
    const int64_t i = t / G, g = t % G, gi = g * nb + i;
    const int32_t* lo = C[t % 2][0];
    const int32_t* hi = C[t % 2][1];
    const __m512 dx = _mm512_loadu_ps(&aa.d[gi * 16]);
    const float* di = d[i % 3];
    const float* dmi = dmin[i % 3];
    const int32_t* mi = mins[i % 3];
    __m512i bs[4];
    if (!q6)
      for (int p = 0; p < 4; ++p) bs[p] = _mm512_loadu_si512(&aa.bs[(gi * 4 + p) * 16]);
    __m512* f = &F[g * 16];
    for (int c = 0; c < 16; ++c) {
      const __m512i S = _mm512_add_epi32(_mm512_load_si512(lo + 16 * c), _mm512_slli_epi32(_mm512_load_si512(hi + 16 * c), 8));
      const __m512 sa = _mm512_mul_ps(dx, _mm512_set1_ps(di[c]));
      if (q6) {
        f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sa, f[c]);
      } else {
        const __m512i mn = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_madd_epi16(bs[0], _mm512_set1_epi32(mi[4 * c])), _mm512_madd_epi16(bs[1], _mm512_set1_epi32(mi[4 * c + 1]))),
            _mm512_add_epi32(_mm512_madd_epi16(bs[2], _mm512_set1_epi32(mi[4 * c + 2])), _mm512_madd_epi16(bs[3], _mm512_set1_epi32(mi[4 * c + 3]))));
        const __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dx, _mm512_set1_ps(dmi[c])));
        f[c] = _mm512_add_ps(f[c], _mm512_fmsub_ps(_mm512_cvtepi32_ps(S), sa, m));
      }
    }
  };
  for (int64_t c0 = 0; c0 < nch; c0 += 16) {
    const uint8_t* wc = w + c0 * row_bytes;
    std::fill(F.begin(), F.end(), _mm512_setzero_ps());
    for (int64_t i = 0; i < std::min<int64_t>(2, nb); ++i) amx_unpack<T>(wc, row_bytes, i, x, A[i], d[i], dmin[i], mins[i]);
    for (int64_t t = 0; t < items; ++t) {
      const int64_t i = t / G, g = t % G;
      const uint8_t* Ai = A[i % 3];
      const int8_t* B = aa.b.data() + (g * nb + i) * 4096;
      _tile_zero(0);
      _tile_zero(1);
      for (int j = 0; j < 4; ++j) {
        _tile_loadd(6, B + 1024 * j, 64);
        _tile_loadd(4, Ai + j * kAmxChunk, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_loadd(5, Ai + j * kAmxChunk + 1024, 64);
        if (q6) _tile_dpbssd(1, 5, 6);
        else _tile_dpbusd(1, 5, 6);
      }
      _tile_stored(0, C[t % 2][0], 64);
      _tile_stored(1, C[t % 2][1], 64);
      if (t > 0) step(t - 1);
      if (g == 0 && i + 2 < nb) {
        const int64_t k = (i + 2) % 3;
        amx_unpack<T>(wc, row_bytes, i + 2, x, A[k], d[k], dmin[k], mins[k]);
      }
    }
    step(items - 1);
    for (int64_t g = 0; g < G; ++g) out(g * 16, std::min<int64_t>(16, M - g * 16), c0, reinterpret_cast<const float*>(&F[g * 16]));
  }
}
#endif

// y = x @ concat(W_0, W_1, ...).T + bias: the segments share the activations' quantization.
at::Tensor qmm(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> types, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "qmm: x must be [M, K]");
  TORCH_CHECK(x.device().is_cpu(), "qmm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "qmm: x must be bf16 or fp32");
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "qmm: one type per weight segment");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> starts{0};
  bool need32 = false, need256 = false;
  int orders = 0;  // the 256-value blocks' activation orders the kernels will read (quantize_rows)
  for (size_t s = 0; s < ws.size(); ++s) {
    const int64_t t = types[s], bb = block_bytes(t);
    TORCH_CHECK(bb > 0, "qmm: unsupported block type ", t);
    const int64_t bs = is_k_quant(t) ? 256 : 32;
    TORCH_CHECK(K % bs == 0, "qmm: K = ", K, " is not a multiple of the block size ", bs);
    TORCH_CHECK(ws[s].scalar_type() == at::kByte && ws[s].dim() == 2 && ws[s].is_contiguous(),
                "qmm: weights must be contiguous uint8 [N, row_bytes]");
    TORCH_CHECK(ws[s].size(1) == K / bs * bb, "qmm: weight rows of ", ws[s].size(1), " bytes do not hold K = ", K);
    (is_k_quant(t) ? need256 : need32) = true;
    orders |= t == kQ6_K ? kOrderQ6 : (t == kQ4_K || t == kQ5_K ? kOrderQ45 : 0);
    starts.push_back(starts.back() + ws[s].size(0) * (is_x16(t) ? 16 : 1));
  }
  const int64_t N = starts.back();
  const float* bp = nullptr;
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "qmm: bias must have N = ", N, " values");
    bp = bf.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  Acts a32, a256;
  if (need32) quantize_rows(x, 32, a32);
  if (need256) quantize_rows(x, 256, a256, orders);
#if defined(SPECDEC_AMX)
  // many rows on k-quants: the tile unit (the same bits as the vector kernels)
  const bool amx = need256 && M >= kAmxMinRows && amx_ok();
  AmxActs aa;
  if (amx) amx_acts(a256, M, aa);
#endif

  // Tiles of channels, claimed dynamically (a descheduled thread does not hold up the call), about four a
  // thread: each thread then streams long runs of contiguous weight rows, which the hardware prefetchers
  // follow (tiles of 16 channels ran a one-token step 14% slower); inside a tile, groups of up to kMaxRows
  // rows share each weight block while it is in registers / L1.
  const int64_t workers = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tile = std::max<int64_t>(64, (N / (4 * workers) + 15) / 16 * 16);
  std::vector<int64_t> tile_seg, tile_n0;
  for (size_t s = 0; s < ws.size(); ++s)
    for (int64_t n = starts[s]; n < starts[s + 1]; n += tile) {
      tile_seg.push_back(static_cast<int64_t>(s));
      tile_n0.push_back(n);
    }
  const int64_t ntiles = static_cast<int64_t>(tile_seg.size());
  const int64_t ngroups = row_groups(M);
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles));
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  at::BFloat16* yb = out_bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    float res[2 * kMaxRows];
    alignas(64) float res16[64];
#if defined(SPECDEC_AMX)
    if (amx) amx_configure();
#endif
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < ntiles;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t s = tile_seg[t], type = types[s];
      const Acts& a = is_k_quant(type) ? a256 : a32;
      const int64_t bs = is_k_quant(type) ? 256 : 32, nb = K / bs, row_bytes = ws[s].size(1);
      const uint8_t* wbase = ws[s].data_ptr<uint8_t>();
      int64_t n0 = tile_n0[t];
      const int64_t n1 = std::min(n0 + tile, starts[s + 1]);
#if defined(SPECDEC_AMX)
      if (amx && is_k_quant(type) && !is_x16(type) && n1 - n0 >= 16) {  // whole groups of 16 channels; the rest below
        const int64_t nch = (n1 - n0) / 16 * 16;
        auto put = [&](int64_t m0, int64_t rows, int64_t c0, const float* v) {
          for (int64_t r = 0; r < rows; ++r)
            for (int j = 0; j < 16; ++j) {
              const int64_t n = n0 + c0 + j, m = m0 + r;
              const float o = bp ? v[16 * j + r] + bp[n] : v[16 * j + r];
              if (out_bf16) yb[m * N + n] = static_cast<at::BFloat16>(o);
              else yf[m * N + n] = o;
            }
        };
        const uint8_t* w0 = wbase + (n0 - starts[s]) * row_bytes;
        if (type == kQ4_K) amx_channels<kQ4_K>(w0, row_bytes, nch, aa, M, put);
        else if (type == kQ5_K) amx_channels<kQ5_K>(w0, row_bytes, nch, aa, M, put);
        else amx_channels<kQ6_K>(w0, row_bytes, nch, aa, M, put);
        n0 += nch;
      }
#endif
      if (is_x16(type)) {  // 16 channels at a time, each serving every row (by up to 4, as even as can be)
        const int64_t G = (M + 3) / 4;
        for (int64_t n = n0; n < n1; n += 16)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t m0 = g * (M / G) + std::min(g, M % G);
            const int rows = static_cast<int>(M / G + (g < M % G ? 1 : 0));
            x16_fn(type, rows)(wbase + (n - starts[s]) / 16 * row_bytes, nb, a, m0, res16);
            for (int r = 0; r < rows; ++r)
              for (int c = 0; c < 16; ++c) {
                const float o = bp ? res16[16 * r + c] + bp[n + c] : res16[16 * r + c];
                if (out_bf16) yb[(m0 + r) * N + n + c] = static_cast<at::BFloat16>(o);
                else yf[(m0 + r) * N + n + c] = o;
              }
          }
        continue;
      }
      for (int64_t g = 0; g < ngroups; ++g) {
        const int64_t m0 = group_start(M, g);
        const int rows = static_cast<int>(group_start(M, g + 1) - m0);
        const DotFn fn = dot_fn(type, rows);
        const Dot2Fn fn2 = dot2_fn(type, rows);
        auto store = [&](int64_t n, const float* v) {
          for (int r = 0; r < rows; ++r) {
            const float o = bp ? v[r] + bp[n] : v[r];
            if (out_bf16) yb[(m0 + r) * N + n] = static_cast<at::BFloat16>(o);
            else yf[(m0 + r) * N + n] = o;
          }
        };
        for (int64_t n = n0; n < n1;) {
          const uint8_t* wn = wbase + (n - starts[s]) * row_bytes;
          if (fn2 != nullptr && n + 1 < n1) {
            const uint8_t* pair[2] = {wn, wn + row_bytes};
            fn2(pair, nb, a, m0, res);
            store(n, res);
            store(n + 1, res + rows);
            n += 2;
          } else {
            fn(wn, nb, a, m0, res);
            store(n, res);
            n += 1;
          }
        }
      }
    }
#if defined(SPECDEC_AMX)
    if (amx) _tile_release();
#endif
  });
  return y;
}

// Quantized activations as the kernels see them (for tests): q int8 [M, K], sums int16 [M, K/16], d [M, K/bs].
std::vector<at::Tensor> quantize_acts(at::Tensor x, int64_t bs) {
  TORCH_CHECK(x.dim() == 2 && (bs == 32 || bs == 256) && x.size(1) % bs == 0, "quantize_acts: bad shape");
  x = x.contiguous();
  Acts a;
  quantize_rows(x, bs, a);
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  auto d = at::empty({M, K / bs}, x.options().dtype(at::kFloat));
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(s.data_ptr<int16_t>(), a.s.data(), a.s.size() * 2);
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * 4);
  return {q, s, d};
}

// ---- the elementwise work around the matmuls, one op each (fewer dispatches per layer) ----------
// Row by row in scalar code (no reassociation: -ffp-contract=off, no -ffast-math), so every build and
// any number of rows give the same bits.

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) per row of the last dimension (the RMSNorm of Llama/Qwen2,
// rounded as the float path rounds: the normalized row to x's dtype, then the product with w).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // 8 partial sums, then one fixed order
      for (int64_t i = 0; i < H; ++i) acc[i & 7] += f32(xr[i]) * f32(xr[i]);
      const float ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) y[r * H + i] = static_cast<T>(f32(w[i]) * f32(static_cast<T>(f32(xr[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == w.scalar_type(), "rms_norm: CPU tensors of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.numel() == H, "rms_norm: weight must have ", H, " values");
  x = x.contiguous();
  w = w.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  const int64_t rows = H ? x.numel() / H : 0;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, H, eps);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, H, eps);
  return y;
}

// Rotary embedding, rotate-half layout: y = x * cos + rotate_half(x) * sin, each product and the sum
// rounded to x's dtype as the float path rounds them. x: [B, T, heads, D] (any strides), cos/sin:
// [B, T, D] contiguous. Returns a contiguous [B, T, heads, D].
template <typename T>
void rope_rows(const at::Tensor& x, const T* cs, const T* sn, T* y) {
  const int64_t B = x.size(0), Tn = x.size(1), Hn = x.size(2), D = x.size(3), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2), sd = x.stride(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const T* c = cs + (b * Tn + t) * D;
      const T* s = sn + (b * Tn + t) * D;
      for (int64_t h = 0; h < Hn; ++h) {
        const T* xr = xp + b * sb + t * st + h * sh;
        T* yr = y + ((b * Tn + t) * Hn + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -f32(xr[(d + half) * sd]) : f32(xr[(d - half) * sd]);
          const T a = static_cast<T>(f32(xr[d * sd]) * f32(c[d]));
          const T bb = static_cast<T>(rot * f32(s[d]));
          yr[d] = static_cast<T>(f32(a) + f32(bb));
        }
      }
    }
}

at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && x.device().is_cpu(), "rope: x [B, T, heads, D], cos/sin [B, T, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "rope: one dtype");
  TORCH_CHECK(x.size(3) % 2 == 0 && cos.size(2) == x.size(3), "rope: head_dim mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto y = at::empty({x.size(0), x.size(1), x.size(2), x.size(3)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    rope_rows<at::BFloat16>(x, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "rope: bf16 or fp32");
  return y;
}

// Attention: attention.cpp (`specdec::attention`).

// One decoder layer of a Llama/Qwen2 model on the block kernels, as `models.llama.DecoderLayer` computes it
// (the same ops in the same order, so the same bits): x + attn(norm1(x)), then + mlp(norm2(.)), where attn
// is qkv -> rope(q), rope(k) -> k, v written to their cache slots -> attention -> o, and mlp is
// down(silu(gate) * up).  One call a layer instead of some forty from Python.  weights: [qkv, o, gate_up,
// down] as segments of blocks with their types; slots [B, T]: the cache slot of each new token.
void write_slots(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {  // src [B, T, KV, D] rows
  const int64_t B = src.size(0), Tn = src.size(1), KV = src.size(2), D = src.size(3), cap = cache.size(2);
  const int64_t esize = src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(cache.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t slot = slots[b * Tn + t];
      TORCH_CHECK(slot >= 0 && slot < cap, "decoder_layer: slot ", slot, " outside the cache");
      for (int64_t g = 0; g < KV; ++g)
        std::memcpy(cp + (((b * KV + g) * cap + slot) * D) * esize,
                    sp + (b * src.stride(0) + t * src.stride(1) + g * src.stride(2)) * esize, D * esize);
    }
}

at::Tensor decoder_layer(at::Tensor x, std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> qkv_w,
                         std::vector<int64_t> qkv_t, c10::optional<at::Tensor> qkv_b, std::vector<at::Tensor> o_w,
                         std::vector<int64_t> o_t, std::vector<at::Tensor> gu_w, std::vector<int64_t> gu_t,
                         std::vector<at::Tensor> dn_w, std::vector<int64_t> dn_t, at::Tensor cos, at::Tensor sin,
                         at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor visible,
                         c10::optional<at::Tensor> key_index, int64_t H, int64_t KV) {
  TORCH_CHECK(x.dim() == 3 && norms.size() == 2 && cos.dim() == 3, "decoder_layer: x [B, T, hidden], two norms");
  const int64_t B = x.size(0), Tn = x.size(1), Hd = x.size(2), D = cos.size(2);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == KV && k_cache.size(3) == D &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(0) >= B, "decoder_layer: cache shapes");
  slots = slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B * Tn, "decoder_layer: slots int64 [B, T]");
  const at::Tensor h = rms_norm(x, norms[0], eps);
  const at::Tensor qkv = qmm(h.view({B * Tn, Hd}), qkv_w, qkv_t, qkv_b).view({B, Tn, (H + 2 * KV) * D});
  const at::Tensor q = rope(qkv.narrow(2, 0, H * D).view({B, Tn, H, D}), cos, sin);
  const at::Tensor k = rope(qkv.narrow(2, H * D, KV * D).view({B, Tn, KV, D}), cos, sin);
  const at::Tensor v = qkv.narrow(2, (H + KV) * D, KV * D).view({B, Tn, KV, D});
  write_slots(k, k_cache, slots.data_ptr<int64_t>());
  write_slots(v, v_cache, slots.data_ptr<int64_t>());
  const at::Tensor a = specdec::attention(q, k_cache, v_cache, visible, key_index);
  const at::Tensor x1 = at::add(x, qmm(a.view({B * Tn, H * D}), o_w, o_t, c10::nullopt).view({B, Tn, Hd}));
  const at::Tensor gu = qmm(rms_norm(x1, norms[1], eps).view({B * Tn, Hd}), gu_w, gu_t, c10::nullopt);
  const int64_t I = gu.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, I)), gu.narrow(1, I, I));
  return at::add(x1, qmm(act, dn_w, dn_t, c10::nullopt).view({B, Tn, Hd}));
}

// Q8_0 or Q5_0 blocks [N, row_bytes] -> Q4_0 blocks [N, K / 32 * 18]: each block's values as the file gives
// them (d x quant, in fp32), quantized as ggml's reference quantizer does (`quantize_q4_0` in qgemm.py: the
// scale m / -8 from the value of largest magnitude, quants min(15, (int) (v / d + 8.5))). A smaller draft.
at::Tensor requantize_q4_0(at::Tensor w, int64_t type) {
  TORCH_CHECK(type == kQ8_0 || type == kQ5_0, "requantize_q4_0: from Q8_0 or Q5_0 blocks, not type ", type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2, "requantize_q4_0: uint8 [N, row_bytes] blocks");
  w = w.contiguous();
  const int64_t in = block_bytes(type), N = w.size(0), nb = w.size(1) / in;
  TORCH_CHECK(w.size(1) % in == 0, "requantize_q4_0: rows of whole blocks");
  auto out = at::empty({N, nb * 18}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * nb, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const uint8_t* b = src + k * in;
      const float d = fp16(b);
      const VI weights = type == kQ8_0 ? q32_weights<kQ8_0>(b) : q32_weights<kQ5_0>(b);
      int8_t q[32];
      std::memcpy(q, &weights, 32);
      float v[32];
      for (int j = 0; j < 32; ++j) v[j] = d * static_cast<float>(q[j]);
      float amax = 0.f, m = 0.f;
      for (int j = 0; j < 32; ++j)
        if (amax < std::fabs(v[j])) { amax = std::fabs(v[j]); m = v[j]; }
      const float dq = m / -8.f, id = dq != 0.f ? 1.f / dq : 0.f;
      uint8_t* o = dst + k * 18;
      const uint16_t h = c10::detail::fp16_ieee_from_fp32_value(dq);
      std::memcpy(o, &h, 2);
      for (int j = 0; j < 16; ++j) {
        const float a = v[j] * id, c = v[16 + j] * id;  // two roundings: a product, then a sum (no fma)
        const int qa = std::min(15, static_cast<int>(a + 8.5f)), qc = std::min(15, static_cast<int>(c + 8.5f));
        o[2 + j] = static_cast<uint8_t>(qa | (qc << 4));
      }
    }
  });
  return out;
}

}  // namespace

// Whether this build multiplies many rows on the tile unit here (the AMX build, once the OS allows it).
bool uses_tiles() {
#if defined(SPECDEC_AMX)
  return amx_ok();
#else
  return false;
#endif
}

TORCH_LIBRARY(SPECDEC_QLIB, m) {
  m.def("uses_tiles() -> bool", &uses_tiles);
  m.def("set_pair_rows(int mask) -> ()", &set_pair_rows);
  m.def("pair_rows() -> int", &pair_rows);
  m.def("qmm(Tensor x, Tensor[] ws, int[] types, Tensor? bias) -> Tensor", &qmm);
  m.def("repack_q4k_x16(Tensor w) -> Tensor", &repack_q4k_x16);
  m.def("repack_q6k_x16(Tensor w) -> Tensor", &repack_q6k_x16);
  m.def("repack_q40_x16(Tensor w) -> Tensor", &repack_q40_x16);
  m.def("repack_q50_x16(Tensor w) -> Tensor", &repack_q50_x16);
  m.def("requantize_q4_0(Tensor w, int type) -> Tensor", &requantize_q4_0);
  m.def("quantize_acts(Tensor x, int bs) -> Tensor[]", &quantize_acts);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor? key_index) -> Tensor", &specdec::attention);
  m.def("decoder_layer(Tensor x, Tensor[] norms, float eps, Tensor[] qkv, int[] qkv_types, Tensor? qkv_bias, "
        "Tensor[] o, int[] o_types, Tensor[] gate_up, int[] gate_up_types, Tensor[] down, int[] down_types, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor visible, "
        "Tensor? key_index, int num_heads, int num_kv_heads) -> Tensor", &decoder_layer);
}
