// Q4_K and Q5_K (GGML types 12, 13): 256 weights a block, 8 sub-blocks of 32 with a six-bit scale and min
// each; their dot products on every build (AVX2 / portable: `dot_q45k`; 512-bit: the kernels under
// SPECDEC_Z512), and their `Format` entries.
#pragma once
#include "../format.h"
#include "../isa/vec.h"

namespace SPECDEC_QLIB {
namespace {

enum : int64_t { kQ4_K = 12, kQ5_K = 13 };  // GGML type ids (ggml.h)

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


#if defined(SPECDEC_Z512)
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
#endif

template <bool Q5>
struct Q45k {
  template <int R>
  static DotFn dot() {  // the blocks of a row side by side (512-bit), or one block at a time
#if defined(SPECDEC_Z512)
    if constexpr (R <= 2) return &dot_q45k_flb<R, Q5>; else return &dot_q45k_fl<R, Q5>;
#else
    return &dot_q45k<R, Q5>;
#endif
  }
  static Dot2Fn dot2(int rows) {
#if defined(SPECDEC_Z512)
    if (pairs_for(rows)) return rows == 1 ? &dot_q45k_zc<1, 2, Q5> : &dot_q45k_zc<2, 2, Q5>;
#endif
    (void)rows;
    return nullptr;
  }
};
constexpr Format kFormatQ4_K{kQ4_K, "Q4_K", 256, 144, 1, kOrderQ45, &by_rows<Q45k<false>>, &Q45k<false>::dot2};
constexpr Format kFormatQ5_K{kQ5_K, "Q5_K", 256, 176, 1, kOrderQ45, &by_rows<Q45k<true>>, &Q45k<true>::dot2};

}  // namespace
}  // namespace SPECDEC_QLIB
