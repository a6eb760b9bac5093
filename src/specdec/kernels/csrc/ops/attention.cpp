// Attention over the K/V cache on CPU: decode, verification (chains and trees) and prefill through one
// implementation, tiled over keys, grouped-query aware, exact and row-invariant.
//
// What a query computes (this defines its bits, but for bf16 on the AMX build's tiles: amx/attention.h;
// `reference_attention` in tests/test_attention.py is the same recipe written in torch). Its visible keys,
// in order (slot j, or key_index[j], for each visible j), are numbered by rank r = 0, 1, ..., n - 1 and cut
// into blocks of kBlock ranks. Then
//   score_r  = dot(q, k_r) * (1 / sqrt(D)), dot: 8 lanes, lane l summing q[d] * k[d] for d = l mod 8 in
//              order (a product, then a sum: no fused multiply-add), then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7));
//   block c: m_c = its largest score (exact in any order), e_r = exp(score_r - m_c) (`exp_nonpositive`:
//              basic operations only), sum_c = its e_r summed in order, acc_c[d] = e_r * v_r[d] likewise;
//   blocks combined in order (`combine`): (m, sum, acc) = block 0's, then for each next block the side
//              with the smaller maximum is scaled by exp(its maximum - the larger) and the two added;
//   out[d]   = acc[d] / sum (0 when the query sees no key), rounded to q's dtype.
// Nothing in it depends on the other queries of the call, their number, where the query's row sits, the
// masked or padded slots, the chunk of prefill, the thread count or the instruction set: every build
// computes the same operations (the vector forms, arch/attention.h and isa/f32.h, are the portable loops'
// order, vectorized), so every build, batch and thread count gives the same bits (bf16 on the AMX build: that
// build's bits, with the same invariances, amx/attention.h).
//
// How it runs. A work item is one sequence's rows (up to kRowBlock of them) and one K/V head: its G x rows
// query vectors. Block c of a query whose keys there are slots s0, s0 + 1, ... (a causal prefix: every
// block but a tree's last) is read from a tile shared by all the item's queries whose block c starts at
// s0: each K/V block is converted (bf16 -> fp32) once for all G heads and all rows of the item (decode,
// a verification pass's K + 1 rows, a prefill chunk's rows), its keys then its values, one block after
// the other (no scores buffer beyond a block). Threads take whole items (prefill, batches), or, when there
// are fewer items than threads (decoding at depth on many cores), ranges of blocks of each item, whose
// parts are then combined in block order: the same operations either way, in one parallel region a call.
//
// Where a slot lives. The cache is [pages, KV, P, D]; slot s of sequence b is row s % P of page
// pages[b][s / P] (paged K/V: a sequence's pages anywhere in a pool shared with the others), or, without a
// table, of page b (one page a row: [rows, KV, capacity, D]). Where a slot lives changes which bytes are
// read, never the operations on them. An int8 cache holds Q8_0 rows (`--kv-cache-dtype q8_0`, kv_quant.h),
// each read as its values q * d: in fp32 here (exactly), in bf16 on the tiles.
#include "../common.h"
#include "../ops.h"
#include "../arch/attention.h"
#include "kv_quant.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

namespace SPECDEC_QLIB {
namespace {

constexpr int64_t kBlock = 64;     // keys (ranks) per block: the unit of tiles, sums and thread splits
constexpr int64_t kRowBlock = 16;  // rows of one sequence per work item when threads take whole items

inline void to_f32(const float* x, float* y, int64_t n) { std::memcpy(y, x, n * sizeof(float)); }

inline void to_f32(const at::BFloat16* x, float* y, int64_t n) {  // bf16 -> fp32: the top 16 bits
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  uint32_t* v = reinterpret_cast<uint32_t*>(y);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>(u[i]) << 16;
}

inline float dot8(const float* a, const float* b, int64_t D) {  // the portable dot product
  float l[8] = {};
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    for (int k = 0; k < 8; ++k) l[k] += a[i + k] * b[i + k];
  for (int k = 0; i + k < D; ++k) l[k] += a[i + k] * b[i + k];
  return reduce8f(l);
}

// s[i * ld + j] = dot(q_i, k_j) * scale for `nq` query vectors q [nq, D] and `len` keys k [len, D].
void score_block(const float* q, int64_t nq, const float* k, int64_t len, int64_t D, float scale, float* s,
                 int64_t ld) {
  const auto tail = [&](int64_t i0, int64_t i1, int64_t j) {  // keys [j, len) of queries [i0, i1)
    for (int64_t x = i0; x < i1; ++x)
      for (int64_t y = j; y < len; ++y) s[x * ld + y] = dot8(q + x * D, k + y * D, D) * scale;
  };
  const int64_t i = score_rows(q, nq, k, len, D, scale, s, ld, tail);  // the vector tiles (arch/attention.h)
  tail(i, nq, 0);
}

// acc[i * stride + d] = sum over j < len, in order, of e[i * ld + j] * v[j * D + d] (from 0), for nq queries.
void weigh_block(const float* e, int64_t ld, int64_t nq, const float* v, int64_t len, int64_t D, float* acc,
                 int64_t stride) {
  int64_t i = weigh_rows(e, ld, nq, v, len, D, acc, stride);  // the vector tiles (arch/attention.h)
  for (; i < nq; ++i) {
    float* a = acc + i * stride;
    std::fill(a, a + D, 0.f);
    for (int64_t j = 0; j < len; ++j) {
      const float p = e[i * ld + j];
      for (int64_t d = 0; d < D; ++d) a[d] += p * v[j * D + d];
    }
  }
}

template <typename T>
struct Call {  // one call's inputs
  const T* q;
  int64_t sb, st, sh, sd;  // q's strides
  const void* kc;
  const void* vc;
  int64_t Tn, H, KV, G, D, P, S;  // P: slots a page
  const bool* visible;
  const int64_t* key_index;
  const int64_t* pages;  // [B, np] each sequence's pages in order, or null: sequence b is page b
  int64_t np;
  float scale;
  T* out;
  bool q8;     // the cache holds Q8_0 rows (kv_quant.h), read as their values q * d; else rows of T
  int64_t rb;  // a cache row's bytes

  // slot s of sequence b, K/V head g, in the cache `base` (kc or vc): its row's first byte
  const char* row(const void* base, int64_t b, int64_t g, int64_t s) const {
    const int64_t page = pages ? pages[b * np + s / P] : b;
    return static_cast<const char*>(base) + ((page * KV + g) * P + s % P) * rb;
  }
  const T* at(const void* base, int64_t b, int64_t g, int64_t s) const {  // (a cache of T)
    return reinterpret_cast<const T*>(row(base, b, g, s));
  }
};

// slots s0 .. s0 + n - 1 of sequence b, head g, in fp32 -> tile [n, D], a page's run at a time.
template <typename T>
void load_run(const Call<T>& a, const void* base, int64_t b, int64_t g, int64_t s0, int64_t n, float* tile) {
  for (int64_t done = 0; done < n;) {
    const int64_t s = s0 + done, m = std::min(n - done, a.P - s % a.P);
    if (a.q8) {
      for (int64_t j = 0; j < m; ++j) q8_to_f32(a.row(base, b, g, s + j), tile + (done + j) * a.D, a.D);
    } else {
      to_f32(a.at(base, b, g, s), tile + done * a.D, m * a.D);
    }
    done += m;
  }
}

// The queries of rows [t0, t1) of sequence b on K/V head g: their visible slots in order, their query
// vectors in fp32 (row r's G heads at rows r * G ... of qf), and, once scored, their scores and maxima.
struct Item {
  int64_t b = 0, g = 0, t0 = 0, t1 = 0;
  std::vector<int64_t> offs, slots;  // row r's slots: slots[offs[r] .. offs[r + 1])
  std::vector<float> qf;  // [nq, D]
  int64_t n_max = 0;

  int64_t rows() const { return t1 - t0; }
  int64_t n(int64_t r) const { return offs[r + 1] - offs[r]; }
  int64_t blocks() const { return (n_max + kBlock - 1) / kBlock; }
};

template <typename T>
void prepare(const Call<T>& a, int64_t b, int64_t g, int64_t t0, int64_t t1, Item& it) {
  it.b = b, it.g = g, it.t0 = t0, it.t1 = t1;
  it.offs.assign(1, 0);
  it.slots.clear();
  it.n_max = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const bool* vis = a.visible + (b * a.Tn + t) * a.S;
    if (a.key_index) {
      const int64_t* idx = a.key_index + (b * a.Tn + t) * a.S;
      for (int64_t j = 0; j < a.S; ++j)
        if (vis[j]) it.slots.push_back(idx[j]);
    } else {  // runs of visible slots (a causal row: one), a run at a time
      for (int64_t j = 0; j < a.S;) {
        const void* on = std::memchr(vis + j, 1, a.S - j);
        if (on == nullptr) break;
        j = static_cast<const bool*>(on) - vis;
        const void* off = std::memchr(vis + j, 0, a.S - j);
        const int64_t end = off ? static_cast<const bool*>(off) - vis : a.S, n0 = it.slots.size();
        it.slots.resize(n0 + end - j);
        std::iota(it.slots.begin() + n0, it.slots.end(), j);
        j = end;
      }
    }
    it.offs.push_back(static_cast<int64_t>(it.slots.size()));
    it.n_max = std::max(it.n_max, it.n(t - t0));
  }
  const int64_t G = a.G, D = a.D;
  it.qf.resize(it.rows() * G * D);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d)
        it.qf[((t - t0) * G + h) * D + d] =
            static_cast<float>(a.q[b * a.sb + t * a.st + (g * G + h) * a.sh + d * a.sd]);
}

// Where each row's block c starts: -1 (it has none), -2 (its keys are scattered slots: a tree's last block),
// else the first of its run of slots. (Without key_index a row's slots increase: a run iff its ends are.)
template <typename T>
void block_starts(const Call<T>& a, const Item& it, int64_t c, std::vector<int64_t>& start) {
  const int64_t R = it.rows(), first = c * kBlock;
  start.assign(R, -1);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = std::min(kBlock, it.n(r) - first);
    if (len <= 0) continue;
    const int64_t* sl = it.slots.data() + it.offs[r] + first;
    bool run = sl[len - 1] - sl[0] == len - 1;
    if (a.key_index)
      for (int64_t j = 1; j < len && run; ++j) run = sl[j] == sl[0] + j;
    start[r] = run ? sl[0] : -2;
  }
}

// Calls fn(r, tile, len) for each row r of the item that has a block c, tile [len, D] (fp32) holding its
// block's keys (or values) in rank order. Rows whose block is a run of slots s0, s0 + 1, ... share one
// tile per s0, converted once; other rows (a tree's scattered keys) gather their own.
template <typename T, typename Fn>
void for_each_tile(const Call<T>& a, const void* base, const Item& it, int64_t c, std::vector<float>& tile,
                   std::vector<int64_t>& start, Fn fn) {
  const int64_t R = it.rows(), D = a.D, first = c * kBlock;
  block_starts(a, it, c, start);
  for (int64_t r = 0; r < R; ++r) {
    if (start[r] == -1) continue;
    const int64_t* sl = it.slots.data() + it.offs[r] + first;
    if (start[r] == -2) {
      const int64_t len = std::min(kBlock, it.n(r) - first);
      tile.resize(len * D);
      for (int64_t j = 0; j < len; ++j) load_run(a, base, it.b, it.g, sl[j], 1, tile.data() + j * D);
      fn(r, tile.data(), len);
      continue;
    }
    const int64_t s0 = start[r];
    int64_t width = 0;
    for (int64_t u = r; u < R; ++u)
      if (start[u] == s0) width = std::max(width, std::min(kBlock, it.n(u) - first));
    const float* keys = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      if (!a.q8 && s0 % a.P + width <= a.P) keys = a.at(base, it.b, it.g, s0);  // in one page: read in place
    }
    if (keys == nullptr) {
      tile.resize(width * D);
      load_run(a, base, it.b, it.g, s0, width, tile.data());
      keys = tile.data();
    }
    for (int64_t u = r; u < R; ++u)
      if (start[u] == s0) {
        fn(u, keys, std::min(kBlock, it.n(u) - first));
        if (u != r) start[u] = -1;
      }
  }
}

}  // namespace
}  // namespace SPECDEC_QLIB

#include "../amx/attention.h"

namespace SPECDEC_QLIB {
namespace {

struct Scratch {
  std::vector<float> tile, scores, part, totals;
  std::vector<int64_t> start;
#if defined(SPECDEC_AMX)
  TileBufs tiles;
#endif
};

// Blocks [c0, c1) of the item, one at a time: for each row that has block c, its G queries' scores, their
// largest, the exponentials, their sum and the weighted sum of the values -> part [G, D + 2] (the sums
// over d, then the sum, then the largest score), handed to fn(c, r, part).
template <typename T, typename Fn>
void run_blocks(const Call<T>& a, const Item& it, int64_t c0, int64_t c1, Scratch& s, Fn fn) {
  const int64_t G = a.G, D = a.D, D2 = D + 2;
#if defined(SPECDEC_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (attention_on_tiles(D)) return run_blocks_tiles(a, it, c0, c1, s.part, s.start, s.tiles, fn);
  }
#endif
  s.scores.resize(it.rows() * G * kBlock);
  s.part.resize(it.rows() * G * D2);
  for (int64_t c = c0; c < c1; ++c) {
    for_each_tile(a, a.kc, it, c, s.tile, s.start, [&](int64_t r, const float* k, int64_t len) {
      score_block(it.qf.data() + r * G * D, G, k, len, D, a.scale, s.scores.data() + r * G * kBlock, kBlock);
    });
    for (int64_t r = 0; r < it.rows(); ++r) {
      const int64_t len = std::min(kBlock, it.n(r) - c * kBlock);
      if (len <= 0) continue;
      float* e0 = s.scores.data() + r * G * kBlock;
      for (int64_t h0 = 0; h0 < G; h0 += 8) {  // each query's largest in order, 8 queries' side by side
        const int64_t n = std::min<int64_t>(8, G - h0);
        float m[8];
        for (int64_t h = 0; h < n; ++h) m[h] = e0[(h0 + h) * kBlock];
        for (int64_t j = 1; j < len; ++j)
          for (int64_t h = 0; h < n; ++h) m[h] = std::max(m[h], e0[(h0 + h) * kBlock + j]);
        for (int64_t h = 0; h < n; ++h) {
          float* e = e0 + (h0 + h) * kBlock;
          for (int64_t j = 0; j < len; ++j) e[j] -= m[h];
          s.part[(r * G + h0 + h) * D2 + D + 1] = m[h];
        }
      }
      if (len == kBlock) {
        exp_nonpositive(e0, G * kBlock);  // (the G queries' blocks at once: the same bits)
      } else {
        for (int64_t h = 0; h < G; ++h) exp_nonpositive(e0 + h * kBlock, len);
      }
      for (int64_t h0 = 0; h0 < G; h0 += 8) {  // each query's sum in order, 8 queries' side by side
        const int64_t n = std::min<int64_t>(8, G - h0);
        float sum[8] = {};
        for (int64_t j = 0; j < len; ++j)
          for (int64_t h = 0; h < n; ++h) sum[h] += e0[(h0 + h) * kBlock + j];
        for (int64_t h = 0; h < n; ++h) s.part[(r * G + h0 + h) * D2 + D] = sum[h];
      }
    }
    for_each_tile(a, a.vc, it, c, s.tile, s.start, [&](int64_t r, const float* v, int64_t len) {
      weigh_block(s.scores.data() + r * G * kBlock, kBlock, G, v, len, D, s.part.data() + r * G * D2, D2);
    });
    for (int64_t r = 0; r < it.rows(); ++r)
      if (it.n(r) > c * kBlock) fn(c, r, s.part.data() + r * G * D2);
  }
}

// A query's running total [D + 2] (as a part) after its block c's part: block 0's part itself; then the
// one of the two whose largest score is smaller scaled by exp(its largest - the other's), and added.
inline void combine(int64_t c, const float* part, float* total, int64_t D) {
  if (c == 0) {
    std::copy(part, part + D + 2, total);
  } else if (part[D + 1] > total[D + 1]) {
    const float alpha = exp_one(total[D + 1] - part[D + 1]);
    for (int64_t d = 0; d <= D; ++d) total[d] = total[d] * alpha + part[d];
    total[D + 1] = part[D + 1];
  } else {
    const float beta = exp_one(part[D + 1] - total[D + 1]);
    for (int64_t d = 0; d <= D; ++d) total[d] = total[d] + part[d] * beta;
  }
}

template <typename T>
void write_out(const Call<T>& a, const Item& it, const float* totals) {  // totals [rows * G, D + 2]
  const int64_t D = a.D;
  for (int64_t r = 0; r < it.rows(); ++r)
    for (int64_t h = 0; h < a.G; ++h) {
      const float* tot = totals + (r * a.G + h) * (D + 2);
      T* o = a.out + ((it.b * a.Tn + it.t0 + r) * a.H + it.g * a.G + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(it.n(r) ? tot[d] / tot[D] : 0.f);
    }
}

// fn(i, scratch) for i in [0, n), handed out one at a time to the threads, in one parallel region.
template <typename Fn>
void run_items(int64_t n, Fn fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    Scratch s;
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t i = next++; i < n; i = next++) fn(i, s);
  });
}

template <typename T>
void attend(const Call<T>& a, int64_t B) {
  const int64_t threads = at::get_num_threads(), D2 = a.D + 2, nq = a.Tn * a.G;
  if (B * a.KV < threads && B * a.Tn <= 64) {
    // Fewer items than threads (decoding at depth on many cores): each sequence's rows in one item,
    // threads over ranges of its blocks, whose parts are then combined in block order.
    std::vector<Item> items(B * a.KV);
    int64_t max_blocks = 0;
    for (int64_t i = 0; i < B * a.KV; ++i) {
      prepare(a, i / a.KV, i % a.KV, 0, a.Tn, items[i]);
      max_blocks = std::max(max_blocks, items[i].blocks());
    }
    if (static_cast<double>(items.size()) * max_blocks * nq * D2 * 4 <= 64e6) {
      const int64_t n_items = items.size(), per = std::max<int64_t>(1, (4 * threads + n_items - 1) / n_items);
      const int64_t chunk = std::max<int64_t>(2, (max_blocks + per - 1) / per);
      const int64_t units = n_items * ((max_blocks + chunk - 1) / chunk);
      std::vector<float> parts(n_items * max_blocks * nq * D2);
      run_items(units, [&](int64_t u, Scratch& s) {
        const int64_t i = u % n_items, c0 = u / n_items * chunk;
        run_blocks(a, items[i], c0, std::min(c0 + chunk, items[i].blocks()), s,
                   [&](int64_t c, int64_t r, const float* part) {
                     std::copy(part, part + a.G * D2, parts.data() + ((i * max_blocks + c) * nq + r * a.G) * D2);
                   });
      });
      std::vector<float> totals(nq * D2);
      for (int64_t i = 0; i < n_items; ++i) {
        const Item& it = items[i];
        for (int64_t r = 0; r < it.rows(); ++r)
          for (int64_t c = 0; c * kBlock < it.n(r); ++c)
            for (int64_t x = r * a.G; x < (r + 1) * a.G; ++x)
              combine(c, parts.data() + ((i * max_blocks + c) * nq + x) * D2, totals.data() + x * D2, a.D);
        write_out(a, it, totals.data());
      }
      return;
    }
  }
  // Threads take whole items (rows of one sequence and K/V head), the longest rows first.
  const int64_t row_blocks = (a.Tn + kRowBlock - 1) / kRowBlock, n_items = B * a.KV * row_blocks;
  run_items(n_items, [&](int64_t i, Scratch& s) {
    const int64_t rb = row_blocks - 1 - i / (B * a.KV), bg = i % (B * a.KV);
    Item it;
    prepare(a, bg / a.KV, bg % a.KV, rb * kRowBlock, std::min(a.Tn, (rb + 1) * kRowBlock), it);
    s.totals.resize(it.rows() * a.G * D2);
    run_blocks(a, it, 0, it.blocks(), s, [&](int64_t c, int64_t r, const float* part) {
      for (int64_t h = 0; h < a.G; ++h)
        combine(c, part + h * D2, s.totals.data() + (r * a.G + h) * D2, a.D);
    });
    write_out(a, it, s.totals.data());
  });
}

}  // namespace

// Whether bf16 attention with heads of `head_dim` runs on the tile unit here (amx/attention.h: its own bits).
bool attention_tiles(int64_t head_dim) {
#if defined(SPECDEC_AMX)
  return attention_on_tiles(head_dim);
#else
  return false;
#endif
}

at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                     c10::optional<at::Tensor> key_index, c10::optional<at::Tensor> pages) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "attention: q [B, T, H, D], keys and values [pages, KV, page size, D]");
  const bool q8 = keys.scalar_type() == at::kChar;  // Q8_0 rows (kv_quant.h)
  TORCH_CHECK(q.device().is_cpu() && (keys.scalar_type() == q.scalar_type() || q8) &&
              values.scalar_type() == keys.scalar_type(), "attention: CPU tensors of one dtype (or a Q8_0 cache)");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "attention: the cache must be contiguous");
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), KV = keys.size(1), P = keys.size(2);
  TORCH_CHECK(keys.size(3) == (q8 ? q8_row_bytes(D) : D) && (!q8 || D % kQ8Block == 0) && KV > 0 && H % KV == 0 &&
              P > 0, "attention: shapes do not match");
  TORCH_CHECK(visible.dim() == 3 && visible.size(0) == B && visible.size(1) == Tn &&
              visible.scalar_type() == at::kBool, "attention: visible must be bool [B, T, S]");
  visible = visible.contiguous();
  const int64_t S = visible.size(2);
  const int64_t* table = nullptr;
  at::Tensor page_table;
  int64_t np = 1;  // without a table: one page a sequence
  if (pages.has_value()) {
    page_table = pages->contiguous();
    TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == B && page_table.scalar_type() == at::kLong,
                "attention: pages [B, pages a sequence] int64");
    table = page_table.data_ptr<int64_t>();
    np = page_table.size(1);
    TORCH_CHECK(std::all_of(table, table + page_table.numel(), [&](int64_t p) { return p >= 0 && p < keys.size(0); }),
                "attention: a page outside the cache");
  } else {
    TORCH_CHECK(keys.size(0) >= B, "attention: fewer cache rows than sequences");
  }
  const int64_t slots = np * P;  // a sequence's slots
  const int64_t* idx = nullptr;
  at::Tensor index;
  if (key_index.has_value()) {
    index = key_index->contiguous();
    TORCH_CHECK(index.sizes() == visible.sizes() && index.scalar_type() == at::kLong, "attention: key_index [B, T, S] int64");
    idx = index.data_ptr<int64_t>();
    const int64_t* end = idx + index.numel();
    TORCH_CHECK(std::all_of(idx, end, [&](int64_t s) { return s >= 0 && s < slots; }),
                "attention: key_index outside the cache");
  } else {
    TORCH_CHECK(S <= slots, "attention: more key slots than the cache holds");
  }
  auto out = at::empty({B, Tn, H, D}, q.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Call<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), q.stride(3),
                    keys.data_ptr(), values.data_ptr(), Tn, H, KV, H / KV, D, P, S,
                    visible.data_ptr<bool>(), idx, table, np, 1.0f / std::sqrt(static_cast<float>(D)),
                    out.data_ptr<T>(), q8, q8 ? q8_row_bytes(D) : D * static_cast<int64_t>(sizeof(T))};
    attend(a, B);
  };
  if (q.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else if (q.scalar_type() == at::kBFloat16)
    run(static_cast<at::BFloat16*>(nullptr));
  else
    TORCH_CHECK(false, "attention: bf16 or fp32");
  return out;
}

}  // namespace SPECDEC_QLIB
