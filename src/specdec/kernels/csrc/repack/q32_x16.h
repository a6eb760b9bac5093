#pragma once
#include "x16.h"
#include "../quant/q32.h"

namespace SPECDEC_QLIB {
namespace {

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
}  // namespace

at::Tensor repack_q40_x16(at::Tensor w) { return repack_q32_x16<false>(w); }
at::Tensor repack_q50_x16(at::Tensor w) { return repack_q32_x16<true>(w); }

namespace {

constexpr int64_t kQ4_0X16 = 102, kQ5_0X16 = 106;  // the kernels' own type ids (Q4_0 / Q5_0 + 100)

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

template <bool Q5>
struct Q32X16 {
  template <int R>
  static DotFn dot() {
#if defined(SPECDEC_Z512)
    return &dot_q32x16<R, Q5>;
#else
    return &dot_q32x16_scalar<R, Q5>;
#endif
  }
};
constexpr Format kFormatQ4_0X16{kQ4_0X16, "Q4_0_X16", 32, kX16Q40Bytes, 16, 0, &by_rows4<Q32X16<false>>, nullptr};
constexpr Format kFormatQ5_0X16{kQ5_0X16, "Q5_0_X16", 32, kX16Q50Bytes, 16, 0, &by_rows4<Q32X16<true>>, nullptr};

}  // namespace
}  // namespace SPECDEC_QLIB
