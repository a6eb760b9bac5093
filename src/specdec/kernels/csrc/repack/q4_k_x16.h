#pragma once
#include "x16.h"
#include "../quant/q45_k.h"

namespace SPECDEC_QLIB {
namespace {

// Q4_K, 16 channels side by side: the channels in the vector lanes.
// `repack_q4k_x16` lays out each block of 16 channels (rows of the weight) side by side, 2368 bytes where
// the file has 16 x 144: d and dmin of the 16 channels (fp16), the 8 six-bit scales unpacked to bytes
// (sc[j][c]), the 8 mins likewise as 4-byte groups (mn[j / 4][c][j % 4]), then the quants: 32 registers of
// 64 bytes whose byte 4c + t holds channel c's value 4u + t (register u) in its low nibble and value 128 +
// 4u + t in its high one. A u8 x s8 dot product of a register's nibbles with 4 activations broadcast adds
// 4 products into each of the 16 channels' lanes at once: no horizontal sums, no tree, and the fp32 steps
// run on 16 channels at once. S and Mn are the exact integers of the other kernels, and the steps are
// step45's lane by lane: the same bits.
constexpr int64_t kX16Bytes = 2368, kX16Dmin = 32, kX16Sc = 64, kX16Mn = 192, kX16Qs = 320;

}  // namespace

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

namespace {

constexpr int64_t kQ4_KX16 = 112;  // the kernels' own type id (Q4_K + 100)

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
#elif defined(SPECDEC_AVX2)
// AVX2: the 16 channels as two halves of 8 (bytes 32h.. of each register): side by side for one or two rows
// (one pass over the weights, which a single row reads from memory), one after the other for 3 or 4 (their
// sums would not fit the registers). maddubs puts 2 products into each i16 lane; a sub-block's 8 registers
// add up in i16 (at most 16 x 15 x 127 = 30480: no overflow), then one madd by the sub-block's scale (both
// i16 halves of a lane) gives the i32 scale x sum: the exact S of the other builds; Mn as the 512-bit kernel
// computes it (dot4 for dpbusd), and the fp32 step is step45's, lane by lane.
template <int R>
void dot_q4kx16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R >= 1 && R <= 4, "one to four rows");
  constexpr int NH = R <= 2 ? 2 : 1;  // halves at once
  const VI m4 = set8(0x0F);
  const Rows<R> rw(a, m0);
  for (int h0 = 0; h0 < 2; h0 += NH) {
    VF f[NH][R];
    for (int hh = 0; hh < NH; ++hh)
      for (int r = 0; r < R; ++r) f[hh][r] = fzero();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * kX16Bytes;
      if (h0 == 0)
        for (int64_t l = 0; l < kX16Bytes; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
      VI S[NH][R];
      for (int hh = 0; hh < NH; ++hh)
        for (int r = 0; r < R; ++r) S[hh][r] = zero();
      for (int j = 0; j < 4; ++j) {  // sub-blocks j (low nibbles) and j + 4 (high nibbles)
        VI al[NH][R], ah[NH][R];
        for (int hh = 0; hh < NH; ++hh)
          for (int r = 0; r < R; ++r) al[hh][r] = ah[hh][r] = zero();
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const int u = 8 * j + k;
          for (int hh = 0; hh < NH; ++hh) {
            const VI P = load(b + kX16Qs + 64 * u + 32 * (h0 + hh));
            const VI ql = and_(P, m4), qh = shr_mask(P, 4, 0x0F);
            for (int r = 0; r < R; ++r) {
              al[hh][r] = add16(al[hh][r], maddubs(ql, bcast32v(rw.q[r] + i * 256 + 4 * u)));
              ah[hh][r] = add16(ah[hh][r], maddubs(qh, bcast32v(rw.q[r] + i * 256 + 128 + 4 * u)));
            }
          }
        }
        for (int hh = 0; hh < NH; ++hh) {
          const int h = h0 + hh;
          const VI sl = scale_pairs_u8(b + kX16Sc + 16 * j + 8 * h), sh = scale_pairs_u8(b + kX16Sc + 16 * (j + 4) + 8 * h);
          for (int r = 0; r < R; ++r) S[hh][r] = add32(S[hh][r], add32(madd(al[hh][r], sl), madd(ah[hh][r], sh)));
        }
      }
      for (int hh = 0; hh < NH; ++hh) {
        const int h = h0 + hh;
        const VI mn0 = load(b + kX16Mn + 32 * h), mn1 = load(b + kX16Mn + 64 + 32 * h);
        const VF dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
        const VF dmv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kX16Dmin + 16 * h)));
        for (int r = 0; r < R; ++r) {
          const uint8_t* lo = rw.lo[r] + i * 8;
          const int8_t* hi = rw.hi[r] + i * 8;
          const VI ml = add32(dot4(bcast32v(lo), mn0), dot4(bcast32v(lo + 4), mn1));
          const VI mh = add32(dot4(mn0, bcast32v(hi)), dot4(mn1, bcast32v(hi + 4)));
          const VI Mn = add32(ml, shl32(mh, 8));
          const VF d = _mm256_set1_ps(rw.d[r][i]);
          const VF m = _mm256_mul_ps(_mm256_cvtepi32_ps(Mn), _mm256_mul_ps(d, dmv));
          f[hh][r] = _mm256_add_ps(f[hh][r], _mm256_fmsub_ps(_mm256_cvtepi32_ps(S[hh][r]), _mm256_mul_ps(d, dv), m));
        }
      }
    }
    for (int hh = 0; hh < NH; ++hh)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 16 * r + 8 * (h0 + hh), f[hh][r]);
  }
}
#endif

struct Q4kX16 {
  template <int R>
  static DotFn dot() {
#if defined(SPECDEC_Z512) || defined(SPECDEC_AVX2)
    return &dot_q4kx16<R>;
#else
    return &dot_q4kx16_scalar<R>;
#endif
  }
};
constexpr Format kFormatQ4_KX16{kQ4_KX16, "Q4_K_X16", 256, kX16Bytes, 16, 0, &by_rows4<Q4kX16>, nullptr};

}  // namespace
}  // namespace SPECDEC_QLIB
