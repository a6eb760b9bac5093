// Matrix products on GGUF's own quantized blocks:  y[M, N] = x[M, K] @ W[N, K].T (+ bias)
//
// W stays in the file's block format (Q4_0, Q5_0, Q8_0: 32 weights a block; Q4_K, Q5_K, Q6_K: 256), one
// row of blocks per output channel, read in place (a memory map of the GGUF).  Each activation row is
// quantized to 8 bits per block (scale amax / 127, one scale per 256 values for the k-quants, per 32 for
// the others, plus sums of every 16 quants), weight block x activation block products are integer dot
// products (exact, so their order does not matter), and block results are combined in fp32.
//
// Row invariance, by construction: the bits of y[m, n] depend only on row m of x and row n of W.  Every
// (row, channel) pair owns its own 8 int32 lanes per block and 8 fp32 lanes over the whole row, updated by
// the same sequence of operations whether the row is computed alone or in a group of up to kMaxRows rows,
// whatever thread takes the channel, then reduced by one fixed horizontal sum.  The integer lanes are
// exact (no saturation: weights are at most 6 bits unsigned, or signed 8 bits through the sign trick,
// activations lie in [-127, 127]), so the AVX2 path (maddubs + madd), the VNNI path (maddubs + dpwssd,
// dpbusd) and the portable path (the same lanes in scalar code) give the same bits.
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

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kMaxRows = 8;  // 32 vector registers
#else
constexpr int kMaxRows = 4;
#endif

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

// ---- quantized activations ----------------------------------------------------------------------

struct Acts {
  int64_t K = 0, bs = 0;     // row length, block size (32 or 256)
  std::vector<int8_t> q;     // [M][K]
  std::vector<int16_t> s;    // [M][K / 16]: sums of 16 quants
  std::vector<int32_t> s32;  // [M][K / 32]: sums of 32 quants
  std::vector<float> d;      // [M][K / bs]: block scales
  const int8_t* qrow(int64_t m) const { return q.data() + m * K; }
  const int16_t* srow(int64_t m) const { return s.data() + m * (K / 16); }
  const int32_t* s32row(int64_t m) const { return s32.data() + m * (K / 32); }
  const float* drow(int64_t m) const { return d.data() + m * (K / bs); }
};

// The rows of a group, resolved once per call of a kernel (no index arithmetic in the block loops).
template <int R>
struct Rows {
  const int8_t* q[R];
  const int16_t* s[R];
  const int32_t* s32[R];
  const float* d[R];
  Rows(const Acts& a, int64_t m0) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.qrow(m0 + r);
      s[r] = a.srow(m0 + r);
      s32[r] = a.s32row(m0 + r);
      d[r] = a.drow(m0 + r);
    }
  }
};

// One row, one block: scale = amax / 127, q = round-half-even(x * 127 / amax), in [-127, 127].
// Elementwise IEEE operations only, so any build (vectorized or not) gives the same bytes.
inline void quantize_block(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
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

void quantize_rows(const at::Tensor& x, int64_t bs, Acts& a) {
  const int64_t M = x.size(0), K = x.size(1);
  a.K = K;
  a.bs = bs;
  a.q.resize(M * K);
  a.s.resize(M * (K / 16));
  a.s32.resize(M * (K / 32));
  a.d.resize(M * (K / bs));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const at::BFloat16* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* r;
      if (bf16) {
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(xb[m * K + k]);
        r = row.data();
      } else {
        r = xf + m * K;
      }
      for (int64_t b = 0; b < K / bs; ++b)
        quantize_block(r + b * bs, bs, a.q.data() + m * K + b * bs, a.s.data() + m * (K / 16) + b * (bs / 16),
                       a.d.data() + m * (K / bs) + b);
      const int16_t* s16 = a.s.data() + m * (K / 16);
      for (int64_t g = 0; g < K / 32; ++g) a.s32[m * (K / 32) + g] = s16[2 * g] + s16[2 * g + 1];
    }
  });
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
inline void k_scales_mins(const uint8_t* q, uint64_t* sc, uint64_t* mn) {  // byte j of *sc: scale j
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
  VF f[R];
  for (int r = 0; r < R; ++r) f[r] = fzero();
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
      const float dx = rw.d[r][i];
      const VI msum = madd(load(rw.s32[r] + i * 8), mins);  // lane j: min j * sum of sub-block j
      // one fp32 step on the chain: f += (acc * dx * d - msum * dx * dmin)
      f[r] = fadd(f[r], fmsub_i(add32(acc[r], acc2[r]), dx * d, fmul_i(msum, dx * dmin)));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(f[r]);
}

// Q6_K (210 bytes: 128 of low nibbles, 64 of 2-bit highs, 16 int8 scales, d): w = d * sc * (q - 32).
template <int R>
void dot_q6k(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  VF f[R];
  for (int r = 0; r < R; ++r) f[r] = fzero();
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
      f[r] = fmadd_i(sub32(add32(acc[r], acc2[r]), shl32(corr, 5)), rw.d[r][i] * d, f[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(f[r]);
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
inline VI halves_sum(__m512i v) {  // lanes 0-7 + lanes 8-15
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
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

// C channels at a time (C = 2 for one or two rows: two independent weight streams keep the core busy
// where one row leaves it waiting on latencies); out[c * R + r].
template <int R, int C, bool Q5>
void dot_q45k_zc(const uint8_t* const* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  constexpr int64_t bytes = Q5 ? 176 : 144;
  const __m512i m0f = _mm512_set1_epi8(0x0F), m01 = _mm512_set1_epi8(1);
  const __m512i sh04 = shifts(0, 4);
  __m512i pick[4];  // i16 lanes 0-15: scale 2j, 16-31: scale 2j + 1
  for (int j = 0; j < 4; ++j) pick[j] = shifts(2 * j, 2 * j + 1);
  VF f[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) f[c][r] = fzero();
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
      for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_si512(rw.q[r] + i * 256 + 64 * j);
      for (int c = 0; c < C; ++c) {
        // [low nibbles | high nibbles] of 32 bytes: sub-blocks 2j and 2j + 1
        __m512i q = _mm512_and_si512(_mm512_srlv_epi16(bcast256(load(qs[c] + 32 * j)), sh04), m0f);
        if (Q5) {
          const __m512i h = _mm512_and_si512(_mm512_srlv_epi16(hb[c], shifts(2 * j, 2 * j + 1)), m01);
          q = _mm512_or_si512(q, _mm512_slli_epi16(h, 4));
        }
        const __m512i s = _mm512_permutexvar_epi16(pick[j], scz[c]);
        for (int r = 0; r < R; ++r) acc[c][r] = madd_acc_z<R * C>(acc[c][r], _mm512_maddubs_epi16(q, x[r]), s);
      }
    }
    for (int c = 0; c < C; ++c) {
      const VI mins = widen32(mn[c]);
      for (int r = 0; r < R; ++r) {
        const float dx = rw.d[r][i];
        const VI msum = madd(load(rw.s32[r] + i * 8), mins);
        f[c][r] = fadd(f[c][r], fmsub_i(halves_sum(acc[c][r]), dx * d[c], fmul_i(msum, dx * dmin[c])));
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c * R + r] = hsum(f[c][r]);
}

template <int R, int C>
void dot_q6k_zc(const uint8_t* const* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  const Rows<R> rw(a, m0);
  const __m512i m0f = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
  const __m512i sh02 = shifts(0, 2), sh46 = shifts(4, 6);
  __m512i pick[4];  // for (h, k): the scales of the four 16-value groups of 64 values, 8 i16 lanes each
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {
      const int g = 8 * h + 4 * k;
      pick[2 * h + k] = _mm512_inserti64x4(
          _mm512_castsi256_si512(pair16(static_cast<int16_t>(g), static_cast<int16_t>(g + 1))),
          pair16(static_cast<int16_t>(g + 2), static_cast<int16_t>(g + 3)), 1);
    }
  VF f[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) f[c][r] = fzero();
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
        const __m512i l = _mm512_loadu_si512(b[c] + 64 * h);  // low nibbles of chunks 0|1, high of 2|3
        const __m512i hb = bcast256(load(b[c] + 128 + 32 * h));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(l, m0f),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh02), m3), 4)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh46), m3), 4)),
        };
        for (int k = 0; k < 2; ++k) {
          const __m512i s = _mm512_permutexvar_epi16(pick[2 * h + k], s16z[c]);
          for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_loadu_si512(rw.q[r] + i * 256 + 128 * h + 64 * k);
            acc[c][r] = madd_acc_z<R * C>(acc[c][r], _mm512_maddubs_epi16(q[k], x), s);
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const VI s16 = scales16(reinterpret_cast<const int8_t*>(b[c] + 192));
      const float d = fp16(b[c] + 208);
      for (int r = 0; r < R; ++r) {
        const VI corr = madd(load(rw.s[r] + i * 16), s16);  // the -32 offset: 32 * sum(sc * bsum)
        f[c][r] = fmadd_i(sub32(halves_sum(acc[c][r]), shl32(corr, 5)), rw.d[r][i] * d, f[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c * R + r] = hsum(f[c][r]);
}

template <int R, bool Q5>
void dot_q45k_z(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  dot_q45k_zc<R, 1, Q5>(&w, nb, a, m0, out);
}

template <int R>
void dot_q6k_z(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  dot_q6k_zc<R, 1>(&w, nb, a, m0, out);
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
#endif

using DotFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, float*);

template <int R>
DotFn dot_for(int64_t type) {
#if defined(SPECDEC_Z512)
  switch (type) {
    case kQ4_K: return &dot_q45k_z<R, false>;
    case kQ5_K: return &dot_q45k_z<R, true>;
    case kQ6_K: return &dot_q6k_z<R>;
    case kQ8_0: return &dot_q32_z<R, kQ8_0>;
    case kQ4_0: return &dot_q32_z<R, kQ4_0>;
    case kQ5_0: return &dot_q32_z<R, kQ5_0>;
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
#endif
  }
  return nullptr;
}

// Two channels at a time, for one or two rows (nullptr: not offered for this type / build).
using Dot2Fn = void (*)(const uint8_t* const*, int64_t, const Acts&, int64_t, float*);
Dot2Fn dot2_fn(int64_t type, int rows) {
#if defined(SPECDEC_Z512)
  if (rows == 1 || rows == 2) {
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

bool is_k_quant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }

int64_t block_bytes(int64_t t) {
  switch (t) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
  }
  return 0;
}

#if defined(SPECDEC_AMX)
// ---- AMX tiles (Sapphire Rapids and later) for the k-quants, many rows at once ------------------------
// The tile unit multiplies 16 x 64 bytes by 64 x 16 bytes into 16 x 16 int32 in one instruction. Here it
// computes the very integer lanes the vector kernels compute (so the same bits, whatever the path):
// lane l of a (row, channel, block) is the sum, over the 32 positions p of the block with p mod 32 in
// [4l, 4l + 4), of scale(p) x weight(p) x activation(p) (Q6_K: weight 0-63, its -32 offset added at the
// end as in the vector kernels). A tile row is one channel's 32 scaled weights of one lane, as two bytes
// (scaled weight = low byte + 256 x high byte), the tile column a row of activations; the 8 lanes are 8
// tile products, then the fp32 steps of the vector kernels, vectorized over 16 rows.
constexpr int kAmxMinRows = 16;  // measured: 1.1x the vector kernels at 16 rows, 1.3-1.5x at 32, 1.5-1.8x at 128; 0.6x at 8

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

// tmm0 / tmm1 (and tmm5 / tmm6, the next lane's): lane sums from the low / high bytes, 16 channels x 16
// rows of int32; tmm2 / tmm3: low / high bytes, 16 channels x 32; tmm4: activations, 8 x (16 rows x 4 bytes)
void amx_configure() {
  TileConfig c;
  for (int t : {0, 1, 5, 6}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 32;
  c.rows[4] = 8;
  c.colsb[4] = 64;
  _tile_loadconfig(&c);
}

// Where a lane's 32 tile bytes come from: tile byte r (r < 32) of lane l holds block position
// pos(l, r), t = r mod 4, m = (r mod 16) / 4, half = r / 16 (the order the weight unpacking below gives):
//   Q4_K / Q5_K: 64 m + 32 half + 4 l + t
//   Q6_K:        128 (m / 2) + 64 half + 32 (m mod 2) + 4 l + t
inline int amx_pos(bool q6, int l, int r) {
  const int t = r % 4, m = (r % 16) / 4, half = r / 16;
  return q6 ? 128 * (m / 2) + 64 * half + 32 * (m % 2) + 4 * l + t : 64 * m + 32 * half + 4 * l + t;
}

// Activations laid out for the tiles, per group of 16 rows (missing rows are zeros) and block.
struct AmxActs {
  int64_t nb = 0;
  std::vector<int8_t> b45, b6;  // [g][i][l][8][16 rows][4]: 512 bytes a (g, i, l)
  std::vector<float> d;         // [g][i][16]: block scales
  std::vector<int32_t> s32;     // [g][i][l][16]: sub-block l's sum (Q4_K / Q5_K mins)
  std::vector<int32_t> s16;     // [g][i][l][16]: i16 pair (sum of group 2l, of group 2l + 1) (Q6_K offset)
};

void amx_acts(const Acts& a, int64_t M, bool q45, bool q6, AmxActs& t) {
  const int64_t nb = a.K / 256, G = (M + 15) / 16;
  t.nb = nb;
  if (q45) t.b45.assign(G * nb * 4096, 0);
  if (q6) t.b6.assign(G * nb * 4096, 0);
  t.d.assign(G * nb * 16, 0.f);
  t.s32.assign(G * nb * 128, 0);
  t.s16.assign(G * nb * 128, 0);
  static const auto pos = [] {  // the dword of the block each (type, lane, 4 bytes) comes from
    std::array<std::array<std::array<int, 8>, 8>, 2> p{};
    for (int q = 0; q < 2; ++q)
      for (int l = 0; l < 8; ++l)
        for (int k4 = 0; k4 < 8; ++k4) p[q][l][k4] = amx_pos(q == 1, l, 4 * k4) / 4;
    return p;
  }();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / 16, n = m % 16;
    const int8_t* q = a.qrow(m);
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t gi = g * nb + i;
      t.d[gi * 16 + n] = a.drow(m)[i];
      int32_t xd[64];  // the block's activations as dwords
      std::memcpy(xd, q + i * 256, 256);
      for (int l = 0; l < 8; ++l) {
        const int64_t at = (gi * 8 + l) * 512 + n * 4;
        for (int k4 = 0; k4 < 8; ++k4) {
          if (q45) std::memcpy(&t.b45[at + k4 * 64], &xd[pos[0][l][k4]], 4);
          if (q6) std::memcpy(&t.b6[at + k4 * 64], &xd[pos[1][l][k4]], 4);
        }
        t.s32[(gi * 8 + l) * 16 + n] = a.s32row(m)[i * 8 + l];
        const int16_t* s = a.srow(m) + i * 16 + 2 * l;
        t.s16[(gi * 8 + l) * 16 + n] =
            static_cast<int32_t>(static_cast<uint16_t>(s[0]) | (static_cast<uint32_t>(static_cast<uint16_t>(s[1])) << 16));
      }
    }
  }
}

// Index vectors of the unpacking (built once).
struct AmxIdx {
  __m512i q45[2], q6[2], q6h[2], q5h[2];  // dword gathers: lanes 0-3 / 4-7
  __m512i lo, hi;                 // low / high bytes of 2 x 32 words -> two lanes' 32-byte rows
  __m512i s45l, s45h;             // scale of each word (Q4_K / Q5_K): from 8 scales
  __m512i s6l[2], s6h[2];         // (Q6_K): from 16 scales, lanes 0-3 / 4-7
  AmxIdx() {
    alignas(64) int32_t a[2][16], b[2][16], c[2][16], e[2][16];
    for (int p = 0; p < 2; ++p)
      for (int lp = 0; lp < 4; ++lp)
        for (int m = 0; m < 4; ++m) {
          const int l = 4 * p + lp;
          a[p][4 * lp + m] = 8 * m + l;                        // qs dword of lane l, chunk m
          b[p][4 * lp + m] = 16 * (m / 2) + 8 * (m % 2) + l;   // ql dword of lane l, (h, a) = m
          c[p][4 * lp + m] = 8 * (m / 2) + l;                  // Q6_K qh dword
          e[p][4 * lp + m] = l;                                // Q5_K qh dword
        }
    for (int p = 0; p < 2; ++p) {
      q45[p] = _mm512_load_si512(a[p]);
      q6[p] = _mm512_load_si512(b[p]);
      q6h[p] = _mm512_load_si512(c[p]);
      q5h[p] = _mm512_load_si512(e[p]);
    }
    alignas(64) int8_t lb[64], hb[64];
    for (int r = 0; r < 64; ++r) {  // row of lane 2k + r / 32: words (r mod 32) of L then H
      const int lane = r / 32, w = lane * 16 + (r % 16), src = (r % 32) < 16 ? 0 : 64;
      lb[r] = static_cast<int8_t>(src + 2 * w);
      hb[r] = static_cast<int8_t>(src + 2 * w + 1);
    }
    lo = _mm512_load_si512(lb);
    hi = _mm512_load_si512(hb);
    alignas(64) int16_t sl[32], sh[32], s6[2][2][32];
    for (int w = 0; w < 32; ++w) {
      const int m = (w % 16) / 4;
      sl[w] = static_cast<int16_t>(2 * m);
      sh[w] = static_cast<int16_t>(2 * m + 1);
      for (int p = 0; p < 2; ++p) {  // group = 2 kk + (lane >= 4), kk = 4 (m / 2) + 2 half + m mod 2
        s6[p][0][w] = static_cast<int16_t>(2 * (4 * (m / 2) + m % 2) + p);
        s6[p][1][w] = static_cast<int16_t>(2 * (4 * (m / 2) + 2 + m % 2) + p);
      }
    }
    s45l = _mm512_load_si512(sl);
    s45h = _mm512_load_si512(sh);
    for (int p = 0; p < 2; ++p) {
      s6l[p] = _mm512_load_si512(s6[p][0]);
      s6h[p] = _mm512_load_si512(s6[p][1]);
    }
  }
};

// Lanes 4p-4p+3 of one block's weights, unpacked as (L, H) nibble vectors (lane per 128 bits, dword m,
// byte t), scaled (words) and split into the low and high bytes of the lane rows at alo / ahi.
inline void amx_scale_store(__m512i L, __m512i H, __m512i sl, __m512i sh, const AmxIdx& x, uint8_t* alo, uint8_t* ahi) {
  for (int k = 0; k < 2; ++k) {  // lanes (2k, 2k + 1) of the four
    const __m512i wl = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(k ? _mm512_extracti64x4_epi64(L, 1) : _mm512_castsi512_si256(L)), sl);
    const __m512i wh = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(k ? _mm512_extracti64x4_epi64(H, 1) : _mm512_castsi512_si256(H)), sh);
    _mm512_storeu_si512(alo + 64 * k, _mm512_permutex2var_epi8(wl, x.lo, wh));
    _mm512_storeu_si512(ahi + 64 * k, _mm512_permutex2var_epi8(wl, x.hi, wh));
  }
}

// One channel's block -> its 8 lane rows (alo / ahi: 256 bytes each), and its scales.
template <bool Q5>
inline void amx_weights_k45(const uint8_t* b, const AmxIdx& x, uint8_t* alo, uint8_t* ahi, float* d, float* dmin, uint64_t* mn) {
  *d = fp16(b);
  *dmin = fp16(b + 2);
  uint64_t sc;
  k_scales_mins(b + 4, &sc, mn);
  const __m512i scw = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(static_cast<long long>(sc))));
  const __m512i sl = _mm512_permutexvar_epi16(x.s45l, scw), sh = _mm512_permutexvar_epi16(x.s45h, scw);
  const uint8_t* qs = b + (Q5 ? 48 : 16);
  const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
  const __m512i m0f = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < 2; ++p) {
    const __m512i P = _mm512_permutex2var_epi32(z0, x.q45[p], z1);
    __m512i L = _mm512_and_si512(P, m0f), H = _mm512_and_si512(_mm512_srli_epi16(P, 4), m0f);
    if (Q5) {  // bit 2m (L) / 2m + 1 (H) of qh byte 4 l + t
      const __m512i qhp = _mm512_permutexvar_epi32(x.q5h[p], _mm512_castsi256_si512(load(b + 16)));  // qh dword l at (l, m)
      const __m512i cnt = _mm512_set_epi16(6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0);
      const __m512i one = _mm512_set1_epi8(1);
      L = _mm512_or_si512(L, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qhp, cnt), one), 4));
      H = _mm512_or_si512(H, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qhp, _mm512_add_epi16(cnt, _mm512_set1_epi16(1))), one), 4));
    }
    amx_scale_store(L, H, sl, sh, x, alo + 128 * p, ahi + 128 * p);
  }
}

inline void amx_weights_q6k(const uint8_t* b, const AmxIdx& x, uint8_t* alo, uint8_t* ahi, float* d) {
  *d = fp16(b + 208);
  const __m512i scw = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
  const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_loadu_si512(b + 64), qh = _mm512_loadu_si512(b + 128);
  const __m512i m0f = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
  // shift of the 2 high bits: L (s = m mod 2) 2 s, H (s = 2 + m mod 2) 2 s; per word of dword m
  const __m512i cl = _mm512_set_epi16(2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0);
  const __m512i ch = _mm512_add_epi16(cl, _mm512_set1_epi16(4));
  for (int p = 0; p < 2; ++p) {
    const __m512i P = _mm512_permutex2var_epi32(z0, x.q6[p], z1);
    const __m512i Q = _mm512_permutexvar_epi32(x.q6h[p], qh);
    const __m512i L = _mm512_or_si512(_mm512_and_si512(P, m0f), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(Q, cl), m3), 4));
    const __m512i H = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(P, 4), m0f),
                                      _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(Q, ch), m3), 4));
    amx_scale_store(L, H, _mm512_permutexvar_epi16(x.s6l[p], scw), _mm512_permutexvar_epi16(x.s6h[p], scw), x,
                    alo + 128 * p, ahi + 128 * p);
  }
}

// The fp32 steps of lane l for 16 channels x 16 rows, from its tile sums (lo, hi: [16 channels][16 rows]);
// ml[c]: channel c's multiplier of the lane's activation sums s (Q4_K / Q5_K: its min; Q6_K: its two
// scales as an i16 pair).
template <bool Q6>
inline void amx_lane_steps(const int32_t* lo, const int32_t* hi, const __m512i s, const int32_t* ml,
                           const __m512* sd, const __m512* sm, __m512* f) {
  for (int c = 0; c < 16; ++c) {
    const __m512i v = _mm512_add_epi32(_mm512_load_si512(lo + 16 * c), _mm512_slli_epi32(_mm512_load_si512(hi + 16 * c), 8));
    const __m512i ms = _mm512_madd_epi16(s, _mm512_set1_epi32(ml[c]));
    if (Q6) {  // the -32 offset, as the vector kernels add it
      f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_slli_epi32(ms, 5))), sd[c], f[c]);
    } else {
      f[c] = _mm512_add_ps(f[c], _mm512_fmsub_ps(_mm512_cvtepi32_ps(v), sd[c], _mm512_mul_ps(_mm512_cvtepi32_ps(ms), sm[c])));
    }
  }
}

// Channels [0, nch) (a multiple of 16) of weight rows w, all M rows: out(m0, rows, c0, v) gives the values of
// rows m0.. (rows of them) x channels c0..c0 + 15 as v[16 x channel + row]. Per 16
// channels: every block unpacked first (each weight row read front to back), then block by block, row
// group by row group, the 8 lane products (two sets of sum tiles, so that one lane's fp32 steps overlap
// the next lane's product).
template <int64_t T, typename Out>
void amx_channels(const uint8_t* w, int64_t row_bytes, int64_t nch, const AmxActs& aa, int64_t M, Out&& out) {
  static const AmxIdx x;
  constexpr bool q6 = T == kQ6_K;
  const int64_t nb = aa.nb, G = (M + 15) / 16;
  const int8_t* bacts = q6 ? aa.b6.data() : aa.b45.data();
  std::vector<__m512i> abuf(nb * 2 * 16 * 256 / 64);  // [i][lo, hi][16 channels][256 bytes]
  std::vector<float> d(nb * 16), dmin(nb * 16);
  std::vector<uint64_t> mn(nb * 16);
  std::vector<int32_t> ml(nb * 8 * 16);  // [i][lane][channel]: the multiplier of amx_lane_steps
  alignas(64) int32_t cbuf[2][2][256];  // [lane parity][lo, hi][16 channels x 16 rows]
  std::vector<__m512> F(G * 8 * 16);
  for (int64_t c0 = 0; c0 < nch; c0 += 16) {
    uint8_t* A = reinterpret_cast<uint8_t*>(abuf.data());
    for (int c = 0; c < 16; ++c)
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + (c0 + c) * row_bytes + i * block_bytes(T);
        prefetch_ahead(b, block_bytes(T));
        uint8_t* lo = A + (i * 2 * 16 + c) * 256;
        if (q6) amx_weights_q6k(b, x, lo, lo + 16 * 256, &d[i * 16 + c]);
        else amx_weights_k45<T == kQ5_K>(b, x, lo, lo + 16 * 256, &d[i * 16 + c], &dmin[i * 16 + c], &mn[i * 16 + c]);
        for (int l = 0; l < 8; ++l) {
          int32_t v;
          if (q6) {
            const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
            v = static_cast<int32_t>(static_cast<uint16_t>(sc[2 * l]) | (static_cast<uint32_t>(static_cast<uint16_t>(sc[2 * l + 1])) << 16));
          } else {
            v = byte_of(mn[i * 16 + c], l);
          }
          ml[(i * 8 + l) * 16 + c] = v;
        }
      }
    std::fill(F.begin(), F.end(), _mm512_setzero_ps());
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* alo = A + i * 2 * 16 * 256;
      const uint8_t* ahi = alo + 16 * 256;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t gi = g * nb + i;
        const __m512 dx = _mm512_loadu_ps(&aa.d[gi * 16]);
        __m512 sd[16], sm[16];
        for (int c = 0; c < 16; ++c) {
          sd[c] = _mm512_mul_ps(dx, _mm512_set1_ps(d[i * 16 + c]));
          sm[c] = q6 ? sd[c] : _mm512_mul_ps(dx, _mm512_set1_ps(dmin[i * 16 + c]));
        }
        const int32_t* sums = q6 ? aa.s16.data() : aa.s32.data();
        for (int l = 0; l <= 8; ++l) {
          if (l < 8) {
            const int8_t* bl = bacts + (gi * 8 + l) * 512;
            _tile_loadd(2, alo + 32 * l, 256);
            _tile_loadd(3, ahi + 32 * l, 256);
            _tile_loadd(4, bl, 64);
            if (l % 2 == 0) {  // (tile numbers must be literals in the intrinsics: the two sets spelled out)
              _tile_zero(0);
              _tile_zero(1);
              _tile_dpbusd(0, 2, 4);
              if (q6) _tile_dpbssd(1, 3, 4);
              else _tile_dpbusd(1, 3, 4);
              _tile_stored(0, cbuf[0][0], 64);
              _tile_stored(1, cbuf[0][1], 64);
            } else {
              _tile_zero(5);
              _tile_zero(6);
              _tile_dpbusd(5, 2, 4);
              if (q6) _tile_dpbssd(6, 3, 4);
              else _tile_dpbusd(6, 3, 4);
              _tile_stored(5, cbuf[1][0], 64);
              _tile_stored(6, cbuf[1][1], 64);
            }
          }
          if (l > 0) {  // the previous lane's fp32 steps
            const int k = l - 1;
            const __m512i sv = _mm512_loadu_si512(&sums[(gi * 8 + k) * 16]);
            amx_lane_steps<q6>(cbuf[k % 2][0], cbuf[k % 2][1], sv, &ml[(i * 8 + k) * 16], sd, sm, &F[(g * 8 + k) * 16]);
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      alignas(64) float v[16 * 16];  // [channel][row]
      for (int c = 0; c < 16; ++c) {
        const __m512* f = &F[g * 8 * 16 + c];  // lane l at f[16 l]; summed as the vector kernels' hsum
        _mm512_store_ps(v + 16 * c, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f[0], f[64]), _mm512_add_ps(f[32], f[96])),
                                                  _mm512_add_ps(_mm512_add_ps(f[16], f[80]), _mm512_add_ps(f[48], f[112]))));
      }
      out(g * 16, std::min<int64_t>(16, M - g * 16), c0, v);
    }
  }
}
#endif

template <typename OutT>
void store_out(OutT* y, float v) { *y = static_cast<OutT>(v); }

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
  for (size_t s = 0; s < ws.size(); ++s) {
    const int64_t t = types[s], bb = block_bytes(t);
    TORCH_CHECK(bb > 0, "qmm: unsupported block type ", t);
    const int64_t bs = is_k_quant(t) ? 256 : 32;
    TORCH_CHECK(K % bs == 0, "qmm: K = ", K, " is not a multiple of the block size ", bs);
    TORCH_CHECK(ws[s].scalar_type() == at::kByte && ws[s].dim() == 2 && ws[s].is_contiguous(),
                "qmm: weights must be contiguous uint8 [N, row_bytes]");
    TORCH_CHECK(ws[s].size(1) == K / bs * bb, "qmm: weight rows of ", ws[s].size(1), " bytes do not hold K = ", K);
    (is_k_quant(t) ? need256 : need32) = true;
    starts.push_back(starts.back() + ws[s].size(0));
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
  if (need256) quantize_rows(x, 256, a256);
#if defined(SPECDEC_AMX)
  // many rows on k-quants: the tile unit (the same bits as the vector kernels)
  const bool amx = need256 && M >= kAmxMinRows && amx_ok();
  AmxActs aa;
  if (amx) {
    bool q45 = false, q6 = false;
    for (int64_t t : types) (t == kQ6_K ? q6 : q45) |= is_k_quant(t);
    amx_acts(a256, M, q45, q6, aa);
  }
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
  const int64_t ngroups = (M + kMaxRows - 1) / kMaxRows;
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles));
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  at::BFloat16* yb = out_bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    float res[2 * kMaxRows];
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
      if (amx && is_k_quant(type) && n1 - n0 >= 16) {  // whole groups of 16 channels; the rest below
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
      for (int64_t g = 0; g < ngroups; ++g) {
        const int64_t m0 = g * kMaxRows;
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
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

// Attention of each query over the keys it may see, one query at a time: softmax(q . k / sqrt(D)) . v.
//
// Row invariance, by construction: a query's output depends on its own q and on the keys and values it
// sees, in the order it sees them, and on nothing else (not on the number of queries or rows in the pass,
// the masked slots, the padding, or the thread count).  Each dot product q . k runs over 16 fp32 lanes
// (lane l takes dims l, l + 16, ...; a multiply then an add, no fused multiply-add) and one fixed
// horizontal sum; the softmax sums and each output dimension's weighted sum of values run over the
// visible keys in order.  The lanes are plain loops the compiler vectorizes (or not, in the portable
// build) without changing any operation, so every build computes the same bits.
//
// q: [B, T, H, D] (any strides); keys, values: [rows, KV, capacity, D] (the cache, contiguous); visible:
// [B, T, S] bool, key j of query (b, t) being cache slot j, or key_index[b, t, j] when given (a tree:
// each node's keys in the order its path, decoded token by token, would see them).  Returns [B, T, H, D].
constexpr int kLanes = 16;

inline void to_f32(const float* x, float* y, int64_t n) { std::memcpy(y, x, n * sizeof(float)); }

inline void to_f32(const at::BFloat16* x, float* y, int64_t n) {  // bf16 -> fp32: the top 16 bits
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  uint32_t* v = reinterpret_cast<uint32_t*>(y);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>(u[i]) << 16;
}

inline float dot_lanes(const float* a, const float* b, int64_t D) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < D; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// exp(x) for x <= 0 (scores less their maximum), in place: Cephes' expf (2^n times a degree-6 polynomial
// on [-ln2/2, ln2/2], within 2 ulp), written in basic operations only so that the compiler vectorizes it
// and every build computes the same bits (std::exp is a library call, scalar).
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];  // exp(-87) ~ 1.6e-38: still a normal float
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
    x[i] = p * scale;
  }
}

template <typename T>
void attend_queries(const at::Tensor& q, const T* kc, const T* vc, int64_t kv_heads, int64_t capacity,
                    const bool* visible, const int64_t* key_index, int64_t S, T* out) {
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), G = H / kv_heads;
  const T* qp = q.data_ptr<T>();
  const int64_t sb = q.stride(0), st = q.stride(1), sh = q.stride(2), sd = q.stride(3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * Tn * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), row(D), acc(G * D), scores, sums(G);
    std::vector<int64_t> slots;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item % kv_heads, bt = item / kv_heads, b = bt / Tn, t = bt % Tn;
      slots.clear();
      const bool* vis = visible + bt * S;
      const int64_t* idx = key_index ? key_index + bt * S : nullptr;
      for (int64_t j = 0; j < S; ++j)
        if (vis[j]) slots.push_back(idx ? idx[j] : j);
      const int64_t n = static_cast<int64_t>(slots.size());
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = f32(qp[b * sb + t * st + (g * G + h) * sh + d * sd]);
      const T* keys = kc + (b * kv_heads + g) * capacity * D;
      const T* values = vc + (b * kv_heads + g) * capacity * D;
      scores.assign(G * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        to_f32(keys + slots[j] * D, row.data(), D);
        for (int64_t h = 0; h < G; ++h) scores[h * n + j] = dot_lanes(qf.data() + h * D, row.data(), D) * scale;
      }
      for (int64_t h = 0; h < G; ++h) {
        float* sc = scores.data() + h * n;
        float top = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < n; ++j) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < n; ++j) sc[j] -= top;
        exp_nonpositive(sc, n);
        for (int64_t j = 0; j < n; ++j) sum += sc[j];
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        to_f32(values + slots[j] * D, row.data(), D);
        for (int64_t h = 0; h < G; ++h) {
          const float p = scores[h * n + j];
          float* a = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        T* o = out + (bt * H + g * G + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(n ? acc[h * D + d] / sums[h] : 0.f);
      }
    }
  });
}

at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                     c10::optional<at::Tensor> key_index) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "attention: q [B, T, H, D], keys and values [rows, KV, capacity, D]");
  TORCH_CHECK(q.device().is_cpu() && keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "attention: CPU tensors of one dtype");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "attention: the cache must be contiguous");
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), KV = keys.size(1);
  TORCH_CHECK(keys.size(3) == D && KV > 0 && H % KV == 0 && keys.size(0) >= B, "attention: shapes do not match");
  TORCH_CHECK(visible.dim() == 3 && visible.size(0) == B && visible.size(1) == Tn &&
              visible.scalar_type() == at::kBool, "attention: visible must be bool [B, T, S]");
  visible = visible.contiguous();
  const int64_t S = visible.size(2);
  const int64_t* idx = nullptr;
  at::Tensor index;
  if (key_index.has_value()) {
    index = key_index->contiguous();
    TORCH_CHECK(index.sizes() == visible.sizes() && index.scalar_type() == at::kLong, "attention: key_index [B, T, S] int64");
    idx = index.data_ptr<int64_t>();
    const int64_t* end = idx + index.numel();
    TORCH_CHECK(std::all_of(idx, end, [&](int64_t s) { return s >= 0 && s < keys.size(2); }),
                "attention: key_index outside the cache");
  } else {
    TORCH_CHECK(S <= keys.size(2), "attention: more key slots than the cache holds");
  }
  auto out = at::empty({B, Tn, H, D}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend_queries<float>(q, keys.data_ptr<float>(), values.data_ptr<float>(), KV, keys.size(2),
                          visible.data_ptr<bool>(), idx, S, out.data_ptr<float>());
  else if (q.scalar_type() == at::kBFloat16)
    attend_queries<at::BFloat16>(q, keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), KV, keys.size(2),
                                 visible.data_ptr<bool>(), idx, S, out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "attention: bf16 or fp32");
  return out;
}

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
  const at::Tensor a = attention(q, k_cache, v_cache, visible, key_index);
  const at::Tensor x1 = at::add(x, qmm(a.view({B * Tn, H * D}), o_w, o_t, c10::nullopt).view({B, Tn, Hd}));
  const at::Tensor gu = qmm(rms_norm(x1, norms[1], eps).view({B * Tn, Hd}), gu_w, gu_t, c10::nullopt);
  const int64_t I = gu.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, I)), gu.narrow(1, I, I));
  return at::add(x1, qmm(act, dn_w, dn_t, c10::nullopt).view({B, Tn, Hd}));
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
  m.def("qmm(Tensor x, Tensor[] ws, int[] types, Tensor? bias) -> Tensor", &qmm);
  m.def("quantize_acts(Tensor x, int bs) -> Tensor[]", &quantize_acts);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor? key_index) -> Tensor", &attention);
  m.def("decoder_layer(Tensor x, Tensor[] norms, float eps, Tensor[] qkv, int[] qkv_types, Tensor? qkv_bias, "
        "Tensor[] o, int[] o_types, Tensor[] gate_up, int[] gate_up_types, Tensor[] down, int[] down_types, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor visible, "
        "Tensor? key_index, int num_heads, int num_kv_heads) -> Tensor", &decoder_layer);
}
