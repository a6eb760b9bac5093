// bf16 attention on the AMX tile unit (the `avx512amx` build, bf16 K/V, head sizes a multiple of 32): a
// block's scores and its weighted values as tile products, so that a pass's cost hardly grows with its rows.
// Part of the AMX kernel set (amx/); included by ops/attention.cpp after its work items (Call, Item,
// block_starts), whose tiles it reads.
//
// Its recipe (the bf16 recipe of this build; fp32 calls, and every other build, keep attention.cpp's):
//   score_r  = (the unit's bf16 dot product of q and k_r, TDPBF16PS, over dims 0..31, 32..63, ... into one
//              fp32 sum from 0) * (1 / sqrt(D));
//   block c: m_c = its largest score, e_r = exp(score_r - m_c) (`exp_nonpositive`) rounded to bf16 (to nearest
//              even), sum_c = the rounded e_r summed in key order, acc_c[d] = the unit's dot product of the
//              rounded e_r and v_r[d] over the block's keys 0..31, then 32..63, into one fp32 sum from 0;
//   blocks combined and divided as in attention.cpp.
// The unit computes each output of a product from its row of A and its column of B alone, in an order fixed
// by the operands' positions (a key's rank in its block, a dim's index), never from the other rows or
// columns of the tile. So a query's bits do not depend on the other queries of its tile, how many keys the
// tile's widest row sees (keys a query does not see weigh exactly 0; padding keys are zeros), how its keys
// were gathered (a run of slots or a tree's scattered ones), the chunk or the thread count; they do differ
// from the portable recipe's (another order of sums, and e_r rounded as FlashAttention does), so this build
// gives bf16 attention bits of its own (tests/test_attention.py proves the invariances bit for bit here, and
// the closeness to softmax attention).
//
// Layout. Scores are computed as S^T = K Q^T: A = 16 keys x 32 dims as the cache holds them, B = 16 queries
// in the unit's pair layout (built once per set of queries), C = 16 keys x 16 queries; the softmax then runs
// with a zmm holding one key's 16 queries (each query's maximum and sum in key order, lane by lane). The
// weights are transposed to A = 16 queries x 32 keys, the values interleaved by key pairs to B, C = 16 queries
// x 16 dims.
#pragma once

#if defined(SPECDEC_AMX)
#include "../isa/f32.h"
#include "../isa/tiles.h"

namespace SPECDEC_QLIB {
namespace {

constexpr int64_t kTileQ = 16;  // queries a tile group
static_assert(kBlock == 64, "attention tiles: a block is two 32-key halves");

struct TileBufs {
  std::vector<uint16_t> k;     // [64, D]: a block's keys where they are not read in place, zero rows past the last
  const uint16_t* kt[4] = {};  // keys 16 j .. 16 j + 15: in the cache (a row every D) or in k
  std::vector<uint16_t> v;     // [32 pairs, 2 D]: its values, keys 2p and 2p + 1 interleaved dim by dim
  std::vector<uint16_t> vrows;  // [2, D]: a pair's values in bf16, from a Q8_0 cache
  std::vector<uint16_t> q;     // [groups][D / 2][16 queries][2]: the queries in the unit's pair layout
  std::vector<int64_t> q_rows;  // the rows (of the item at hand) whose queries `q` holds
  std::vector<float> s;         // [64 keys, 16 queries]
  std::vector<uint32_t> p;      // [2 halves][16 queries][16 key pairs]: the weights' A tiles
  std::vector<float> acc;       // [16 queries, D]
};

// Whether a call's bf16 attention runs on tiles (then its bits are this file's recipe).
inline bool attention_on_tiles(int64_t D) { return D % 32 == 0 && D <= 256 && amx_ok(); }

inline void attention_tiles_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Keys and values of the block's `width` ranks into tb.k and tb.v: slots s0, s0 + 1, ... (a run, page by
// page) or, with `slots`, those slots; zeros up to the tiles' 16 keys (values: 32). A Q8_0 cache's rows are
// read as bf16(q * d).
inline void tiles_load(const Call<at::BFloat16>& a, const Item& it, int64_t s0, const int64_t* slots,
                       int64_t width, TileBufs& tb) {
  const int64_t D = a.D;
  const int64_t kw = (width + 15) / 16 * 16, pairs = (width + 31) / 32 * 16;
  tb.k.resize(kBlock * D);
  tb.v.resize(kBlock * D);
  const auto key = [&](const void* base, int64_t j) {  // the block's key (or value) of rank j: its row
    return a.row(base, it.b, it.g, slots ? slots[j] : s0 + j);
  };
  const auto copy = [&](const void* base, int64_t j, uint16_t* o) {  // ... as bf16 (Q8_0: q * d, rounded)
    if (a.q8)
      q8_to_bf16(key(base, j), o, D);
    else
      std::memcpy(o, key(base, j), D * 2);
  };
  for (int64_t j = 0; j < kw; j += 16) {  // each 16 keys' A tile: in place (16 of a run in one page), or copied
    if (!a.q8 && !slots && j + 16 <= width && (s0 + j) % a.P + 16 <= a.P) {
      tb.kt[j / 16] = reinterpret_cast<const uint16_t*>(key(a.kc, j));
      continue;
    }
    uint16_t* o = tb.k.data() + j * D;
    const int64_t n = std::min<int64_t>(16, width - j);
    for (int64_t x = 0; x < n; ++x) copy(a.kc, j + x, o + x * D);
    std::fill(o + n * D, o + 16 * D, 0);
    tb.kt[j / 16] = o;
  }
  std::fill(tb.v.begin() + (width + 1) / 2 * 2 * D, tb.v.begin() + pairs * 2 * D, 0);
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  tb.vrows.resize(2 * D);
  const auto value = [&](int64_t j, int t) -> const uint16_t* {
    if (!a.q8) return reinterpret_cast<const uint16_t*>(key(a.vc, j));
    copy(a.vc, j, tb.vrows.data() + t * D);
    return tb.vrows.data() + t * D;
  };
  for (int64_t p = 0; 2 * p < width; ++p) {
    const uint16_t* v0 = value(2 * p, 0);
    const uint16_t* v1 = 2 * p + 1 < width ? value(2 * p + 1, 1) : nullptr;
    uint16_t* o = tb.v.data() + p * 2 * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(v0 + d), y = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(o + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// The queries of `rows` (G each, row-major) in the unit's pair layout, 16 a group (zeros past the last).
inline void tiles_queries(const Call<at::BFloat16>& a, const Item& it, const std::vector<int64_t>& rows,
                          TileBufs& tb) {
  const int64_t G = a.G, D = a.D, nq = rows.size() * G, groups = (nq + kTileQ - 1) / kTileQ;
  tb.q.assign(groups * kTileQ * D, 0);
  for (int64_t x = 0; x < nq; ++x) {
    const float* qf = it.qf.data() + (rows[x / G] * G + x % G) * D;  // bf16 values: their top 16 bits
    uint16_t* o = tb.q.data() + (x / kTileQ) * kTileQ * D + (x % kTileQ) * 2;
    for (int64_t d = 0; d < D; ++d) {
      uint32_t bits;
      std::memcpy(&bits, qf + d, 4);
      o[(d / 2) * 2 * kTileQ + d % 2] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

// bf16 (to nearest even) of x in [0, 1], in the low 16 bits of each lane
inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}

// Rows r[0 .. 15] of 16 int32 -> their transpose, in place.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// One group of up to 16 queries (x0 .. x0 + n - 1 of `rows` x G) over the block in tb.k / tb.v, `width`
// keys: their parts [D + 2] into part (row r, head h at (r G + h) (D + 2)).
inline void tiles_group(const Call<at::BFloat16>& a, const std::vector<int64_t>& rows, const Item& it, int64_t c,
                        int64_t x0, int64_t n, int64_t width, TileBufs& tb, float* part) {
  const int64_t G = a.G, D = a.D, D2 = D + 2, kw = (width + 15) / 16 * 16, halves = (width + 31) / 32;
  const uint16_t* qt = tb.q.data() + (x0 / kTileQ) * kTileQ * D;
  tb.s.resize(kBlock * kTileQ);
  // scores: 16 keys x 16 queries a product (C: tmm0, tmm1 for two groups of keys side by side; A: their keys,
  // tmm2, tmm3; B: the queries' dims 32 j .. 32 j + 31, tmm4 + j, loaded once when D <= 128, else in tmm4)
  const int64_t chunks = D / 32;
  const bool resident = chunks <= 4;
  if (resident) {
    _tile_loadd(4, qt, 64);
    if (chunks > 1) _tile_loadd(5, qt + 32 * kTileQ, 64);
    if (chunks > 2) _tile_loadd(6, qt + 64 * kTileQ, 64);
    if (chunks > 3) _tile_loadd(7, qt + 96 * kTileQ, 64);
  }
  for (int64_t k0 = 0; k0 < kw; k0 += 32) {
    const bool two = k0 + 16 < kw;
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (int64_t j = 0; j < chunks; ++j) {
      _tile_loadd(2, tb.kt[k0 / 16] + 32 * j, D * 2);
      if (two) _tile_loadd(3, tb.kt[k0 / 16 + 1] + 32 * j, D * 2);
      if (!resident) _tile_loadd(4, qt + 32 * j * kTileQ, 64);
#define SPECDEC_SCORES(B)             \
  _tile_dpbf16ps(0, 2, B);            \
  if (two) _tile_dpbf16ps(1, 3, B);   \
  break;
      switch (resident ? j : 0) {
        case 0: SPECDEC_SCORES(4)
        case 1: SPECDEC_SCORES(5)
        case 2: SPECDEC_SCORES(6)
        default: SPECDEC_SCORES(7)
      }
#undef SPECDEC_SCORES
    }
    _tile_stored(0, tb.s.data() + k0 * kTileQ, 64);
    if (two) _tile_stored(1, tb.s.data() + (k0 + 16) * kTileQ, 64);
  }
  alignas(64) int32_t lens[kTileQ] = {};
  for (int64_t i = 0; i < n; ++i)
    lens[i] = static_cast<int32_t>(std::min(kBlock, it.n(rows[(x0 + i) / G]) - c * kBlock));
  const __m512i len = _mm512_load_si512(lens);
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < width; ++j) {
    const __mmask16 in = _mm512_cmpgt_epi32_mask(len, _mm512_set1_epi32(static_cast<int32_t>(j)));
    const __m512 sj = _mm512_mul_ps(_mm512_loadu_ps(tb.s.data() + j * kTileQ), scale);
    _mm512_storeu_ps(tb.s.data() + j * kTileQ, sj);
    m = _mm512_mask_max_ps(m, in, m, sj);
  }
  m = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(len, _mm512_setzero_si512()), _mm512_setzero_ps(), m);
  // the weights in bf16, keys 2k and 2k + 1 packed in one int32 a query (the unit's pairs), summed in key
  // order; then each 16 pairs x 16 queries transposed into an A tile (16 queries x 32 keys)
  __m512 sum = _mm512_setzero_ps();
  __m512i pr[32];
  for (int64_t k = 0; k < halves * 16; ++k) {
    __m512i w[2];
    for (int64_t t = 0; t < 2; ++t) {
      const int64_t j = 2 * k + t;
      if (j >= width) {
        w[t] = _mm512_setzero_si512();
        continue;
      }
      const __mmask16 in = _mm512_cmpgt_epi32_mask(len, _mm512_set1_epi32(static_cast<int32_t>(j)));
      const __m512 e = exp_vec<F16>(_mm512_sub_ps(_mm512_loadu_ps(tb.s.data() + j * kTileQ), m));
      w[t] = _mm512_maskz_mov_epi32(in, bf16_bits(e));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w[t], 16)));
    }
    pr[k] = _mm512_or_si512(w[0], _mm512_slli_epi32(w[1], 16));
  }
  tb.p.resize(2 * 256);
  for (int64_t h = 0; h < halves; ++h) {
    transpose16x16(pr + 16 * h);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tb.p.data() + h * 256 + i * 16, pr[16 * h + i]);
  }
  // weighted values: 16 queries x 16 dims a product (A: the weights' halves, tmm1 and tmm3; C: two groups of
  // dims side by side, tmm0 and tmm5; B: their values, tmm2 and tmm6, then tmm4 and tmm7)
  _tile_loadd(1, tb.p.data(), 64);
  if (halves > 1) _tile_loadd(3, tb.p.data() + 256, 64);
  // into the parts themselves when the group's queries are consecutive there (the tile's 16 rows may run past
  // them into parts not yet computed, or already combined: `part` has 16 spare), else through tb.acc
  const auto at = [&](int64_t x) { return rows[x / G] * G + x % G; };  // query x's part
  bool in_place = true;
  for (int64_t x = x0 + 1; x < x0 + n && in_place; ++x) in_place = at(x) == at(x0) + (x - x0);
  tb.acc.resize(kTileQ * D);
  float* acc = in_place ? part + at(x0) * D2 : tb.acc.data();
  const int64_t ld = in_place ? D2 : D;
  const uint16_t* v = tb.v.data();
  for (int64_t d = 0; d < D; d += 32) {
    _tile_zero(0);
    _tile_zero(5);
    _tile_loadd(2, v + 2 * d, D * 4);
    _tile_loadd(6, v + 2 * d + 32, D * 4);
    _tile_dpbf16ps(0, 1, 2);
    _tile_dpbf16ps(5, 1, 6);
    if (halves > 1) {
      _tile_loadd(4, v + 32 * D + 2 * d, D * 4);
      _tile_loadd(7, v + 32 * D + 2 * d + 32, D * 4);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(5, 3, 7);
    }
    _tile_stored(0, acc + d, ld * 4);
    _tile_stored(5, acc + d + 16, ld * 4);
  }
  alignas(64) float sums[kTileQ], maxes[kTileQ];
  _mm512_store_ps(sums, sum);
  _mm512_store_ps(maxes, m);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = x0 + i;
    float* o = part + at(x) * D2;
    if (!in_place) std::copy(tb.acc.data() + i * D, tb.acc.data() + (i + 1) * D, o);
    o[D] = sums[i], o[D + 1] = maxes[i];
  }
}

// `run_blocks` for bf16 on tiles: blocks [c0, c1) of the item, fn(c, r, part) for each row r that has block c.
template <typename Fn>
void run_blocks_tiles(const Call<at::BFloat16>& a, const Item& it, int64_t c0, int64_t c1, std::vector<float>& part,
                      std::vector<int64_t>& start, TileBufs& tb, Fn fn) {
  const int64_t R = it.rows(), G = a.G, D2 = a.D + 2;
  part.resize((R * G + kTileQ) * D2);
  attention_tiles_configure();
  tb.q_rows.clear();
  std::vector<int64_t> rows;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t first = c * kBlock;
    block_starts(a, it, c, start);
    for (int64_t r = 0; r < R; ++r) {
      if (start[r] == -1) continue;
      rows.assign(1, r);
      if (start[r] >= 0)
        for (int64_t u = r + 1; u < R; ++u)
          if (start[u] == start[r]) rows.push_back(u), start[u] = -1;
      int64_t width = 0;
      for (int64_t u : rows) width = std::max(width, std::min(kBlock, it.n(u) - first));
      tiles_load(a, it, start[r], start[r] >= 0 ? nullptr : it.slots.data() + it.offs[r] + first, width, tb);
      if (rows != tb.q_rows) tiles_queries(a, it, rows, tb), tb.q_rows = rows;
      const int64_t nq = rows.size() * G;
      for (int64_t x0 = 0; x0 < nq; x0 += kTileQ)
        tiles_group(a, rows, it, c, x0, std::min(kTileQ, nq - x0), width, tb, part.data());
      for (int64_t u : rows) fn(c, u, part.data() + u * G * D2);
    }
  }
  _tile_release();
}

}  // namespace
}  // namespace SPECDEC_QLIB
#endif
