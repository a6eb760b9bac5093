#pragma once
#include "x16.h"
#include "../quant/q6_k.h"

namespace SPECDEC_QLIB {
namespace {

// Q6_K, 16 channels side by side (`repack_q6k_x16`), 3360 bytes as in the file: d of the 16 channels (fp16),
// the 16 signed scales (sc[j][c]), the low 4 bits of the quants as Q4_K's 32 registers (low nibble: value
// 4u + t, high nibble: 128 + 4u + t, in byte 4c + t of register u), then their high 2 bits in 16 registers:
// byte 4c + t of register h holds those of values 4h + t, 128 + 4h + t, 64 + 4h + t and 192 + 4h + t (bits
// 0-1, 2-3, 4-5, 6-7). The lanes of a 16-value sub-block start from -32 x the row's sum of its 16 quants
// (Q6_K's offset), then S = the sum of scale x lane: the exact integer of the other kernels; step6.
constexpr int64_t kX16Q6Bytes = 3360, kX16Q6Sc = 32, kX16Q6Lo = 288, kX16Q6Hi = 2336;

}  // namespace

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

namespace {

constexpr int64_t kQ6_KX16 = 114;  // the kernels' own type id (Q6_K + 100)

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
// Where a kernel takes a block's quants from: the block, their 4 + 2 bits joined as they are read (`dot`), or the
// bytes that `unpack` put them in once for every group of rows (`wide_x16`)
struct Q6kBits {
  const uint8_t* b;
  void get(int u, __m512i& ql, __m512i& qh) const {
    __builtin_prefetch(b + kX16Ahead + kX16Q6Lo + 64 * u, 0, 1);
    if (u < 16) __builtin_prefetch(b + kX16Ahead + kX16Q6Hi + 64 * u, 0, 1);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i P = _mm512_loadu_si512(b + kX16Q6Lo + 64 * u);
    const __m512i H = _mm512_srli_epi16(_mm512_loadu_si512(b + kX16Q6Hi + 64 * (u % 16)), 4 * (u / 16));
    ql = _mm512_or_si512(_mm512_and_si512(P, m4), _mm512_and_si512(_mm512_slli_epi16(H, 4), m30));
    qh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(P, 4), m4), _mm512_and_si512(_mm512_slli_epi16(H, 2), m30));
  }
};

// One block of R rows: f[r] += its step. J pairs of sub-blocks (j, j + 8) at a time: 2 J R accumulators of 4
// chained dot products each
template <int R, typename Q>
inline void q6kx16_block(const uint8_t* b, const Q& q, const Rows<R>& rw, int64_t i, __m512 (&f)[R]) {
  constexpr int J = R <= 2 ? 4 : 2;
  const int8_t* const* x = rw.q;
  const int16_t* const* s16 = rw.s;
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
        __m512i ql, qh;
        q.get(u, ql, qh);
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
  for (int r = 0; r < R; ++r) f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(_mm512_set1_ps(rw.d[r][i]), dv), f[r]);
}

template <int R>
void dot_q6kx16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R >= 1 && R <= 4, "one to four rows");
  const Rows<R> rw(a, m0);
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * kX16Q6Bytes;
    for (int64_t l = 0; l < kX16Q6Lo; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
    q6kx16_block<R>(b, Q6kBits{b}, rw, i, f);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, f[r]);
}

struct Q6kX16Wide {
  static constexpr int64_t kBytes = kX16Q6Bytes;
  static void unpack(const uint8_t* b, uint8_t* un) {
    const Q6kBits q{b};
    for (int u = 0; u < 32; ++u) {
      __m512i ql, qh;
      q.get(u, ql, qh);
      _mm512_store_si512(un + 128 * u, ql);
      _mm512_store_si512(un + 128 * u + 64, qh);
    }
  }
  template <int R>
  static void rows(const uint8_t* b, const uint8_t* un, const Acts& a, int64_t m, int64_t i, float* out) {
    __m512 f[R];
    for (int r = 0; r < R; ++r) f[r] = _mm512_loadu_ps(out + 16 * r);
    q6kx16_block<R>(b, X16Bytes{un}, Rows<R>(a, m), i, f);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, f[r]);
  }
};
#elif defined(SPECDEC_AVX2)
// AVX2: two halves of 8 channels, side by side for one or two rows, else one after the other (as Q4_K's).
// The quants (0..63) times the activations by maddubs, two registers of a sub-block added in i16 (at most
// 4 x 63 x 127 = 32004), then one madd by the sub-block's signed scale; the offset enters once a block as -32
// x the sum over sub-blocks of scale x the row's sum of 16 quants (madd of scale pairs by sum pairs). S is
// the exact integer of the other builds (every partial sum fits 32 bits); step6.
struct Q6kBits {  // the quants from the block (Q6kX16Wide: from bytes unpacked once)
  const uint8_t* b;
  void get(int u, int h, VI& ql, VI& qh) const {
    const VI m4 = set8(0x0F), m30 = set8(0x30);
    const VI P = load(b + kX16Q6Lo + 64 * u + 32 * h);
    const VI H = _mm256_srli_epi16(load(b + kX16Q6Hi + 64 * (u % 16) + 32 * h), 4 * (u / 16));
    ql = or_(and_(P, m4), and_(_mm256_slli_epi16(H, 4), m30));
    qh = or_(shr_mask(P, 4, 0x0F), and_(_mm256_slli_epi16(H, 2), m30));
  }
};

// One block of R rows, halves h0 .. h0 + NH - 1: f[hh][r] += its step
template <int NH, int R, typename Q>
inline void q6kx16_block(const uint8_t* b, const Q& q, int h0, const Rows<R>& rw, int64_t i, VF (&f)[NH][R]) {
  VI S[NH][R], O[NH][R];  // O: the sum of scale x sum of 16 quants, over the block's sub-blocks
  for (int hh = 0; hh < NH; ++hh)
    for (int r = 0; r < R; ++r) S[hh][r] = O[hh][r] = zero();
  for (int hh = 0; hh < NH; ++hh)
    for (int j = 0; j < 16; j += 2) {
      const int h = h0 + hh;
      const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kX16Q6Sc + 16 * j + 8 * h));
      const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kX16Q6Sc + 16 * (j + 1) + 8 * h));
      const VI sp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));  // lane c: (sc_j, sc_j+1)
      for (int r = 0; r < R; ++r) O[hh][r] = add32(O[hh][r], madd(sp, bcast32v(rw.s[r] + i * 16 + j)));
    }
  for (int j = 0; j < 8; ++j) {  // sub-blocks j (registers 4j.., low nibbles) and j + 8 (high nibbles)
#pragma GCC unroll 2
    for (int k = 0; k < 4; k += 2) {
      VI al[NH][R], ah[NH][R];
      for (int kk = 0; kk < 2; ++kk) {
        const int u = 4 * j + k + kk;
        for (int hh = 0; hh < NH; ++hh) {
          VI ql, qh;
          q.get(u, h0 + hh, ql, qh);
          for (int r = 0; r < R; ++r) {
            const VI pl = maddubs(ql, bcast32v(rw.q[r] + i * 256 + 4 * u));
            const VI ph = maddubs(qh, bcast32v(rw.q[r] + i * 256 + 128 + 4 * u));
            al[hh][r] = kk == 0 ? pl : add16(al[hh][r], pl);
            ah[hh][r] = kk == 0 ? ph : add16(ah[hh][r], ph);
          }
        }
      }
      for (int hh = 0; hh < NH; ++hh) {
        const int h = h0 + hh;
        const VI sl = scale_pairs_i8(b + kX16Q6Sc + 16 * j + 8 * h), sh = scale_pairs_i8(b + kX16Q6Sc + 16 * (j + 8) + 8 * h);
        for (int r = 0; r < R; ++r) S[hh][r] = add32(S[hh][r], add32(madd(al[hh][r], sl), madd(ah[hh][r], sh)));
      }
    }
  }
  for (int hh = 0; hh < NH; ++hh) {
    const VF dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * (h0 + hh))));
    for (int r = 0; r < R; ++r) {
      const VI St = sub32(S[hh][r], shl32(O[hh][r], 5));
      f[hh][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(St), _mm256_mul_ps(_mm256_set1_ps(rw.d[r][i]), dv), f[hh][r]);
    }
  }
}

template <int R>
void dot_q6kx16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, float* out) {
  static_assert(R >= 1 && R <= 4, "one to four rows");
  constexpr int NH = R <= 2 ? 2 : 1;  // halves at once
  const Rows<R> rw(a, m0);
  for (int h0 = 0; h0 < 2; h0 += NH) {
    VF f[NH][R];
    for (int hh = 0; hh < NH; ++hh)
      for (int r = 0; r < R; ++r) f[hh][r] = fzero();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * kX16Q6Bytes;
      if (h0 == 0)
        for (int64_t l = 0; l < kX16Q6Bytes; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
      q6kx16_block<NH, R>(b, Q6kBits{b}, h0, rw, i, f);
    }
    for (int hh = 0; hh < NH; ++hh)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 16 * r + 8 * (h0 + hh), f[hh][r]);
  }
}

struct Q6kX16Wide {
  static constexpr int64_t kBytes = kX16Q6Bytes;
  static void unpack(const uint8_t* b, uint8_t* un) {
    const Q6kBits q{b};
    for (int u = 0; u < 32; ++u)
      for (int h = 0; h < 2; ++h) {
        VI ql, qh;
        q.get(u, h, ql, qh);
        _mm256_store_si256(reinterpret_cast<VI*>(un + 128 * u + 32 * h), ql);
        _mm256_store_si256(reinterpret_cast<VI*>(un + 128 * u + 64 + 32 * h), qh);
      }
  }
  template <int R>
  static void rows(const uint8_t* b, const uint8_t* un, const Acts& a, int64_t m, int64_t i, float* out) {
    constexpr int NH = R <= 2 ? 2 : 1;
    const Rows<R> rw(a, m);
    for (int h0 = 0; h0 < 2; h0 += NH) {
      VF f[NH][R];
      for (int hh = 0; hh < NH; ++hh)
        for (int r = 0; r < R; ++r) f[hh][r] = _mm256_loadu_ps(out + 16 * r + 8 * (h0 + hh));
      q6kx16_block<NH, R>(b, X16Bytes{un}, h0, rw, i, f);
      for (int hh = 0; hh < NH; ++hh)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 16 * r + 8 * (h0 + hh), f[hh][r]);
    }
  }
};
#endif

struct Q6kX16 {
  template <int R>
  static DotFn dot() {
#if defined(SPECDEC_Z512) || defined(SPECDEC_AVX2)
    return &dot_q6kx16<R>;
#else
    return &dot_q6kx16_scalar<R>;
#endif
  }
};
#if defined(SPECDEC_Z512) || defined(SPECDEC_AVX2)
constexpr WideFn kWideQ6kX16 = &wide_x16<Q6kX16Wide>;
#else
constexpr WideFn kWideQ6kX16 = nullptr;  // (the portable build: groups of rows as they come)
#endif
constexpr Format kFormatQ6_KX16{kQ6_KX16, "Q6_K_X16", 256, kX16Q6Bytes, 16, 0, &by_rows4<Q6kX16>, nullptr, kWideQ6kX16};

}  // namespace
}  // namespace SPECDEC_QLIB
