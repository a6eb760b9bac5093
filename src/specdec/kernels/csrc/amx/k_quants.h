// The AMX tile unit (Sapphire Rapids and later) for the k-quants: `amx_channels`, used by qmm for many rows.
// Part of the AMX kernel set (amx/: the `avx512amx` build only): it reads the k-quants' blocks (quant/), so it
// lives here rather than in the instruction-set layer (isa/tiles.h: the unit's set-up, which knows no format).
#pragma once
#include "../isa/tiles.h"
#include "../quant/q45_k.h"
#include "../quant/q6_k.h"

#if defined(SPECDEC_AMX)
namespace SPECDEC_QLIB {
namespace {

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

inline bool amx_runs(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

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
constexpr int64_t amx_block_bytes() { return T == kQ6_K ? kFormatQ6_K.bytes : (T == kQ5_K ? kFormatQ5_K.bytes : kFormatQ4_K.bytes); }

template <int64_t T>
inline void amx_unpack(const uint8_t* w, int64_t row_bytes, int64_t i, const AmxIdx& x, uint8_t* A, float* d,
                       float* dmin, int32_t* mins) {
  const uint8_t* next = w + 16 * row_bytes + i * 16 * amx_block_bytes<T>();
  for (int64_t l = 0; l < 16 * amx_block_bytes<T>(); l += 64) __builtin_prefetch(next + l, 0, 2);
  for (int c = 0; c < 16; ++c) {
    const uint8_t* b = w + c * row_bytes + i * amx_block_bytes<T>();
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

}  // namespace
}  // namespace SPECDEC_QLIB
#endif
