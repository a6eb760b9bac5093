// The vector forms of attention's two block products (ops/attention.cpp: `score_block`, `weigh_block`): tiles
// of queries x keys (or dims) whose accumulators stay in registers, on the 256-bit (AVX2) and 512-bit
// (AVX-512) builds. Each computes the portable loops' operations in their order, lane by lane (isa/f32.h), so
// the op's bits do not depend on which of them ran; the portable build has none (`score_rows` and `weigh_rows`
// do nothing there, and the op's loops take every query).
#pragma once
#include "../isa/f32.h"

namespace SPECDEC_QLIB {
namespace {

#if defined(__AVX2__)
// NQ queries x NK keys of `score_block` (NQ * NK a multiple of 4, at most 12: the accumulators stay in
// registers; each key's vector is loaded once for the NQ queries).
template <int NQ, int NK>
inline void score_tile(const float* q, const float* k, int64_t D, __m128 scale, float* s, int64_t ld) {
  __m256 a[NQ * NK];
#pragma GCC unroll 16
  for (int x = 0; x < NQ * NK; ++x) a[x] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[NK];
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) kv[j] = _mm256_loadu_ps(k + j * D + d);
#pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i) {
      const __m256 x = _mm256_loadu_ps(q + i * D + d);
#pragma GCC unroll 16
      for (int j = 0; j < NK; ++j) a[i * NK + j] = _mm256_add_ps(a[i * NK + j], _mm256_mul_ps(x, kv[j]));
    }
  }
  float out[NQ * NK];
#pragma GCC unroll 16
  for (int x = 0; x < NQ * NK; x += 4)
    _mm_storeu_ps(out + x, _mm_mul_ps(reduce4x8(a[x], a[x + 1], a[x + 2], a[x + 3]), scale));
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) s[i * ld + j] = out[i * NK + j];
}

// NQ queries x NV vectors of dims of `weigh_block` (NQ * NV accumulators in registers; each value vector
// loaded once): every dim's products added in key order, whatever the vector width.
template <typename F, int NQ, int NV>
inline void weigh_tile(const float* e, int64_t ld, const float* v, int64_t len, int64_t D, float* acc,
                       int64_t stride) {
  using V = typename F::V;
  V a[NQ * NV];
#pragma GCC unroll 32
  for (int x = 0; x < NQ * NV; ++x) a[x] = F::zero();
  for (int64_t j = 0; j < len; ++j) {
    V vv[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) vv[c] = F::load(v + j * D + F::kLanes * c);
#pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i) {
      const V p = F::set1(e[i * ld + j]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) a[i * NV + c] = F::add(a[i * NV + c], F::mul(p, vv[c]));
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) F::store(acc + i * stride + F::kLanes * c, a[i * NV + c]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The same tiles on 512-bit vectors, the same operations lane for lane: in `score_tile_z` a zmm holds two
// keys' 8 lanes (keys 2p and 2p + 1 of the tile: halves 0 and 1), each lane adding its products in the order
// of `score_tile`, and its halves reduced by `reduce4x8` (`weigh_tile` on `F16`: a zmm holds 16 dims). Half
// the arithmetic instructions of the 256-bit tiles, and twice the keys (or dims) a tile: the bits do not change.
template <int NQ, int NP>  // NQ queries x 2 * NP keys
inline void score_tile_z(const float* q, const float* k, int64_t D, __m128 scale, float* s, int64_t ld) {
  __m512 a[NQ * NP];
#pragma GCC unroll 32
  for (int x = 0; x < NQ * NP; ++x) a[x] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 kv[NP];
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p)
      kv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k + 2 * p * D + d)),
                                 _mm256_loadu_ps(k + (2 * p + 1) * D + d), 1);
#pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i) {
      const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + i * D + d));
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) a[i * NP + p] = _mm512_add_ps(a[i * NP + p], _mm512_mul_ps(x, kv[p]));
    }
  }
  constexpr int NK = 2 * NP;
  static_assert(NK % 4 == 0, "score_tile_z: whole groups of 4 keys");
#pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 16
    for (int p = 0; p < NP; p += 2) {  // keys 2p .. 2p + 3 of query i
      const __m512 u = a[i * NP + p], w = a[i * NP + p + 1];
      const __m128 r = reduce4x8(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1), _mm512_castps512_ps256(w),
                                 _mm512_extractf32x8_ps(w, 1));
      _mm_storeu_ps(s + i * ld + 2 * p, _mm_mul_ps(r, scale));
    }
}
#endif

// `score_block` on tiles: s[i * ld + j] = dot(q_i, k_j) * scale for the first queries (by 6, 2, then 1), each
// query's keys by whole tiles and the rest through tail(i0, i1, j) (keys [j, len) of queries [i0, i1), the
// portable dot product). Returns the queries done: 0 where the build has no tiles or D is not of 8s.
template <typename Tail>
inline int64_t score_rows(const float* q, int64_t nq, const float* k, int64_t len, int64_t D, float scale, float* s,
                          int64_t ld, Tail tail) {
  int64_t i = 0;
#if defined(__AVX2__)
  if (D % 8 == 0) {
    const __m128 sc = _mm_set1_ps(scale);
    for (; i + 6 <= nq; i += 6) {  // the real target's 6 query heads of a K/V head
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      for (; j + 8 <= len; j += 8) score_tile_z<6, 4>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
#endif
      for (; j + 2 <= len; j += 2) score_tile<6, 2>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
      tail(i, i + 6, j);
    }
    for (; i + 2 <= nq; i += 2) {
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      for (; j + 8 <= len; j += 8) score_tile_z<2, 4>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
#endif
      for (; j + 4 <= len; j += 4) score_tile<2, 4>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
      tail(i, i + 2, j);
    }
    for (; i < nq; ++i) {
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      for (; j + 8 <= len; j += 8) score_tile_z<1, 4>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
#endif
      for (; j + 4 <= len; j += 4) score_tile<1, 4>(q + i * D, k + j * D, D, sc, s + i * ld + j, ld);
      tail(i, i + 1, j);
    }
  }
#endif
  return i;
}

// `weigh_block` on tiles for the first queries: acc[i * stride + d] = sum over j < len, in order, of
// e[i * ld + j] * v[j * D + d]. Returns the queries done (0 where the build has no tiles or D does not fit them).
inline int64_t weigh_rows(const float* e, int64_t ld, int64_t nq, const float* v, int64_t len, int64_t D, float* acc,
                          int64_t stride) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (D % 64 == 0) {
    for (; i + 6 <= nq; i += 6)
      for (int64_t d = 0; d < D; d += 64) weigh_tile<F16, 6, 4>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
    for (; i + 2 <= nq; i += 2)
      for (int64_t d = 0; d < D; d += 64) weigh_tile<F16, 2, 4>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
    for (; i < nq; ++i)
      for (int64_t d = 0; d < D; d += 64) weigh_tile<F16, 1, 4>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
  }
#endif
#if defined(__AVX2__)
  if (D % 16 == 0)
    for (; i + 6 <= nq; i += 6)
      for (int64_t d = 0; d < D; d += 16) weigh_tile<F8, 6, 2>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
  if (D % 32 == 0) {
    for (; i + 2 <= nq; i += 2)
      for (int64_t d = 0; d < D; d += 32) weigh_tile<F8, 2, 4>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
    for (; i < nq; ++i)
      for (int64_t d = 0; d < D; d += 32) weigh_tile<F8, 1, 4>(e + i * ld, ld, v + d, len, D, acc + i * stride + d, stride);
  }
#endif
  return i;
}

}  // namespace
}  // namespace SPECDEC_QLIB
