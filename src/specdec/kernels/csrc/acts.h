#pragma once
#include "isa/vec.h"
#include "arch/acts.h"

namespace SPECDEC_QLIB {
namespace {

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
// skipped by the maximum and becomes -127, in both forms), so the vector forms (arch/acts.h) give the bytes of
// the scalar one.
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

inline void quantize_block(const float* x, int64_t bs, int8_t* q, int16_t* s, float* d) {
  if (!quantize_block_vec(x, bs, q, s, d)) quantize_block_scalar(x, bs, q, s, d);  // arch/acts.h
}

inline void bf16_to_f32(const at::BFloat16* x, int64_t n, float* y) {
  int64_t k = bf16_to_f32_vec(x, n, y);  // arch/acts.h
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
#if defined(SPECDEC_Z512)
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


}  // namespace
}  // namespace SPECDEC_QLIB
