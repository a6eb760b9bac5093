// Q6_K (GGML type 14): 256 weights a block, 16 sub-blocks of 16 with a signed 8-bit scale each; its dot
// products on every build (AVX2 / portable: `dot_q6k`; 512-bit: under SPECDEC_Z512), and its `Format` entry.
#pragma once
#include "../format.h"
#include "../isa/vec.h"

namespace SPECDEC_QLIB {
namespace {

enum : int64_t { kQ6_K = 14 };  // GGML type id (ggml.h)

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


#if defined(SPECDEC_Z512)
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
#endif

struct Q6k {
  template <int R>
  static DotFn dot() {
#if defined(SPECDEC_Z512)
    if constexpr (R == 1) return &dot_q6k_fl1; else return &dot_q6k_fl<R>;
#else
    return &dot_q6k<R>;
#endif
  }
  static Dot2Fn dot2(int rows) {
#if defined(SPECDEC_Z512)
    if (pairs_for(rows)) return rows == 1 ? &dot_q6k_zc<1, 2> : &dot_q6k_zc<2, 2>;
#endif
    (void)rows;
    return nullptr;
  }
};
constexpr Format kFormatQ6_K{kQ6_K, "Q6_K", 256, 210, 1, kOrderQ6, &by_rows<Q6k>, &Q6k::dot2};

}  // namespace
}  // namespace SPECDEC_QLIB
