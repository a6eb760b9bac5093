// Q4_0, Q5_0 and Q8_0 (GGML types 2, 6, 8): 32 weights and one fp16 scale a block; their dot products on
// every build (`dot_q32`; 512-bit: `dot_q32_zg`), their `Format` entries, and the ops `widen_q50_q80` and
// `requantize_q4_0`.
#pragma once
#include "../format.h"
#include "../isa/vec.h"
#include "../ops.h"

namespace SPECDEC_QLIB {
namespace {

enum : int64_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8 };  // GGML type ids (ggml.h)

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

#if defined(SPECDEC_Z512)
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

template <int64_t T>
struct Q32 {
  template <int R>
  static DotFn dot() {
#if defined(SPECDEC_Z512)
    return &dot_q32_zg<R, T>;
#else
    return &dot_q32<R, T>;
#endif
  }
};
constexpr Format kFormatQ4_0{kQ4_0, "Q4_0", 32, 18, 1, 0, &by_rows<Q32<kQ4_0>>, nullptr};
constexpr Format kFormatQ5_0{kQ5_0, "Q5_0", 32, 22, 1, 0, &by_rows<Q32<kQ5_0>>, nullptr};
constexpr Format kFormatQ8_0{kQ8_0, "Q8_0", 32, 34, 1, 0, &by_rows<Q32<kQ8_0>>, nullptr};

}  // namespace

// Q5_0 blocks [N, K / 32 * 22] -> Q8_0 blocks [N, K / 32 * 34]: each block's scale and its 32 weights as the
// signed bytes the Q5_0 kernels compute from it (`q32_weights`), so a Q8_0 product of them is the Q5_0 one,
// bit for bit, without the fifth bits' unpacking (the AVX2 build's Q5_0 product is bound by it).
at::Tensor widen_q50_q80(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) % 22 == 0,
              "widen_q50_q80: uint8 [N, K / 32 * 22] Q5_0 blocks");
  w = w.contiguous();
  const int64_t N = w.size(0), nb = w.size(1) / 22;
  auto out = at::empty({N, nb * 34}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * nb, 16384, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const VI q = q32_weights<kQ5_0>(src + k * 22);
      std::memcpy(dst + k * 34, src + k * 22, 2);
      std::memcpy(dst + k * 34 + 2, &q, 32);
    }
  });
  return out;
}

// Q8_0 or Q5_0 blocks [N, row_bytes] -> Q4_0 blocks [N, K / 32 * 18]: each block's values as the file gives
// them (d x quant, in fp32), quantized as ggml's reference quantizer does (`quantize_q4_0` in qgemm.py: the
// scale m / -8 from the value of largest magnitude, quants min(15, (int) (v / d + 8.5))). A smaller draft.
at::Tensor requantize_q4_0(at::Tensor w, int64_t type) {
  TORCH_CHECK(type == kQ8_0 || type == kQ5_0, "requantize_q4_0: from Q8_0 or Q5_0 blocks, not type ", type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2, "requantize_q4_0: uint8 [N, row_bytes] blocks");
  w = w.contiguous();
  const int64_t in = (type == kQ8_0 ? kFormatQ8_0 : kFormatQ5_0).bytes, N = w.size(0), nb = w.size(1) / in;
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

}  // namespace SPECDEC_QLIB
