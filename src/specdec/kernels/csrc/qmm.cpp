// Matrix products on GGUF's own quantized blocks:  y[M, N] = x[M, K] @ W[N, K].T (+ bias)
//
// W stays in the file's block format (Q4_0, Q5_0, Q8_0: 32 weights a block; Q4_K, Q5_K, Q6_K: 256), one
// row of blocks per output channel, read in place (a memory map of the GGUF).  Each activation row is
// quantized to 8 bits per block (scale amax / 127, one scale per 256 values for the k-quants, per 32 for
// the others, plus sums of every 16 quants), weight block x activation block products are integer dot
// products (exact, so their order does not matter), and block results are combined in fp32.
//
// Row invariance, by construction: the bits of y[m, n] depend only on row m of x and row n of W.  For the
// k-quants each (row, channel, 256-value block) gives exact integers (S = the sum of scale x weight x
// activation over the block; Q4_K / Q5_K also Mn = the sum of min x activation), and the channel's fp32 value
// takes one step per block, in block order (`step45` / `step6`: the same few IEEE operations everywhere).
// The 32-value types keep, per (row, channel), 8 int32 lanes per block and 8 fp32 lanes over the row,
// reduced by one fixed horizontal sum.  Integers are exact (no saturation: weights are at most 6 bits
// unsigned, or signed 8 bits through the sign trick, activations lie in [-127, 127]), so however a build
// gets them (AVX2 maddubs + madd, AVX-512 VNNI, AMX tile products, scalar code) and whatever other rows,
// row count or thread computes alongside, the fp32 steps see the same values and give the same bits.
//
// What a type is (its block size, bytes, kernels) comes from its entry in the table of formats (formats.h).
// Registered as torch.ops.<library>.qmm (registration.cpp); the library name comes from -DSPECDEC_QLIB (one
// per ISA build).

#include "formats.h"
#include "amx/k_quants.h"
#include "ops.h"

namespace SPECDEC_QLIB {

// Two channels at a time, for one or two rows: which of the two row counts take them is the process's choice
// (`set_pair_rows`, bit r - 1 for r rows; `pairs_for` in format.h): they give the bits of the one-channel
// kernels, and which is faster depends on the core (measured: on Sapphire Rapids the two streams hide
// latencies for one or two rows; on Zen 4 the one-channel kernel is faster, the two-row pair costing about
// what 4 rows do in one channel). qgemm.py sets it from the tuning file ($SPECDEC_HOME/tuning.json).
constexpr int64_t kX16RowBlock = 128;
// From this many rows in a block, the 16-channel layouts that have a wide kernel (Q6_K's) unpack each weight
// block once for all of them (`Format::wide`) rather than once a group of 4; 0: never (`set_wide_rows`, to
// measure one against the other: the bits are the same). Measured on Zen 4, one thread, Q6_K: 16 rows 1.16x
// (AVX2) and 1.05x (AVX-512), 128 rows 1.25x and 1.13x; 8 rows 0.97-0.99x. Q4_K's nibbles cost too little
// to gain from it (1.03x on AVX2 at 128 rows, 0.91x on AVX-512): it has none.
std::atomic<int64_t> g_wide_rows{16};

void set_wide_rows(int64_t rows) { g_wide_rows.store(rows); }
int64_t wide_rows() { return g_wide_rows.load(); }

void set_pair_rows(int64_t mask) { g_pair_rows.store(static_cast<int>(mask & 3)); }
int64_t pair_rows() { return g_pair_rows.load(); }

// Whether this build multiplies many rows on the tile unit here (the AMX build, once the OS allows it).
bool uses_tiles() {
#if defined(SPECDEC_AMX)
  return amx_ok();
#else
  return false;
#endif
}

// The table of formats, for tests and qgemm.py: (type, values, bytes, channels) of each entry in turn.
std::vector<int64_t> formats() {
  std::vector<int64_t> out;
  for (const Format* f : kFormats) out.insert(out.end(), {f->type, f->values, f->bytes, f->channels});
  return out;
}

// y = x @ concat(W_0, W_1, ...).T + bias: the segments share the activations' quantization.  y in out_dtype
// (default: x's), each output rounded once from its fp32 value.
at::Tensor qmm(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> types, c10::optional<at::Tensor> bias,
               c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "qmm: x must be [M, K]");
  TORCH_CHECK(x.device().is_cpu(), "qmm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "qmm: x must be bf16 or fp32");
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_type == at::kBFloat16 || out_type == at::kFloat, "qmm: out_dtype must be bf16 or fp32");
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "qmm: one type per weight segment");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> starts{0};
  std::vector<const Format*> fmts;  // each segment's entry in the table
  bool need32 = false, need256 = false;
  int orders = 0;  // the 256-value blocks' activation orders the kernels will read (quantize_rows)
  for (size_t s = 0; s < ws.size(); ++s) {
    const Format* f = find_format(types[s]);
    TORCH_CHECK(f != nullptr, "qmm: unsupported block type ", types[s]);
    const int64_t bb = f->bytes, bs = f->values;
    TORCH_CHECK(K % bs == 0, "qmm: K = ", K, " is not a multiple of the block size ", bs);
    TORCH_CHECK(ws[s].scalar_type() == at::kByte && ws[s].dim() == 2 && ws[s].is_contiguous(),
                "qmm: weights must be contiguous uint8 [N, row_bytes]");
    TORCH_CHECK(ws[s].size(1) == K / bs * bb, "qmm: weight rows of ", ws[s].size(1), " bytes do not hold K = ", K);
    (bs == 256 ? need256 : need32) = true;
    orders |= f->orders;
    starts.push_back(starts.back() + ws[s].size(0) * f->channels);
    fmts.push_back(f);
  }
  const int64_t N = starts.back();
  const float* bp = nullptr;
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "qmm: bias must have N = ", N, " values");
    bp = bf.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options().dtype(out_type));
  if (M == 0 || N == 0) return y;

  Acts a32, a256;
  if (need32) quantize_rows(x, 32, a32);
  if (need256) quantize_rows(x, 256, a256, orders);
#if defined(SPECDEC_AMX)
  // many rows on k-quants: the tile unit (the same bits as the vector kernels)
  const bool amx = need256 && M >= kAmxMinRows && amx_ok();
  AmxActs aa;
  if (amx) amx_acts(a256, M, aa);
#endif

  // Tiles of channels, claimed dynamically (a descheduled thread does not hold up the call), about four a
  // thread: each thread then streams long runs of contiguous weight rows, which the hardware prefetchers
  // follow (tiles of 16 channels ran a one-token step 14% slower); inside a tile, groups of up to kMaxRows
  // rows share each weight block while it is in registers / L1.
  const int64_t workers = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tile = std::max<int64_t>(64, (N / (4 * workers) + 15) / 16 * 16);
  std::vector<int64_t> tile_seg, tile_n0;
  for (size_t s = 0; s < ws.size(); ++s)
    for (int64_t n = starts[s]; n < starts[s + 1]; n += tile) {
      tile_seg.push_back(static_cast<int64_t>(s));
      tile_n0.push_back(n);
    }
  const int64_t ntiles = static_cast<int64_t>(tile_seg.size());
  const int64_t ngroups = row_groups(M);
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles));
  const bool out_bf16 = out_type == at::kBFloat16;
  const int64_t wide_from = g_wide_rows.load(std::memory_order_relaxed);
  at::BFloat16* yb = out_bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    float res[2 * kMaxRows];
    alignas(64) float res16[64];
    alignas(64) float wide[16 * kX16RowBlock];
#if defined(SPECDEC_AMX)
    if (amx) amx_configure();
#endif
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < ntiles;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t s = tile_seg[t], type = types[s];
      const Format& f = *fmts[s];
      const Acts& a = f.values == 256 ? a256 : a32;
      const int64_t bs = f.values, nb = K / bs, row_bytes = ws[s].size(1);
      const uint8_t* wbase = ws[s].data_ptr<uint8_t>();
      int64_t n0 = tile_n0[t];
      const int64_t n1 = std::min(n0 + tile, starts[s + 1]);
#if defined(SPECDEC_AMX)
      if (amx && amx_runs(type) && n1 - n0 >= 16) {  // whole groups of 16 channels; the rest below
        const int64_t nch = (n1 - n0) / 16 * 16;
        auto put = [&](int64_t m0, int64_t rows, int64_t c0, const float* v) {
          for (int64_t r = 0; r < rows; ++r)
            for (int j = 0; j < 16; ++j) {
              const int64_t n = n0 + c0 + j, m = m0 + r;
              const float o = bp ? v[16 * j + r] + bp[n] : v[16 * j + r];
              if (out_bf16) yb[m * N + n] = static_cast<at::BFloat16>(o);
              else yf[m * N + n] = o;
            }
        };
        const uint8_t* w0 = wbase + (n0 - starts[s]) * row_bytes;
        if (type == kQ4_K) amx_channels<kQ4_K>(w0, row_bytes, nch, aa, M, put);
        else if (type == kQ5_K) amx_channels<kQ5_K>(w0, row_bytes, nch, aa, M, put);
        else amx_channels<kQ6_K>(w0, row_bytes, nch, aa, M, put);
        n0 += nch;
      }
#endif
      if (f.channels == 16) {  // 16 channels at a time, each serving every row (by up to 4, as even as can be)
        // Many rows go in blocks of kX16RowBlock: a block's activations stay in L2 while it sweeps the tile's
        // columns (all 512 rows of a prompt chunk at once were read from L3 for every column: gate/up 1.2x
        // and Q6_K down 1.2x the time, AVX2 build). Which rows share a kernel call never changes the bits.
        auto put = [&](int64_t n, int64_t m0, int64_t rows, const float* v) {  // v[16 r + c] -> y[m0 + r, n + c]
          for (int64_t r = 0; r < rows; ++r)
            for (int c = 0; c < 16; ++c) {
              const float o = bp ? v[16 * r + c] + bp[n + c] : v[16 * r + c];
              if (out_bf16) yb[(m0 + r) * N + n + c] = static_cast<at::BFloat16>(o);
              else yf[(m0 + r) * N + n + c] = o;
            }
        };
        for (int64_t r0 = 0; r0 < M; r0 += kX16RowBlock) {
          const int64_t MB = std::min(kX16RowBlock, M - r0), G = (MB + 3) / 4;
          for (int64_t n = n0; n < n1; n += 16) {
            const uint8_t* wn = wbase + (n - starts[s]) / 16 * row_bytes;
            if (f.wide != nullptr && wide_from > 0 && MB >= wide_from) {  // each weight block unpacked once for all MB rows
              f.wide(wn, nb, a, r0, MB, wide);
              put(n, r0, MB, wide);
              continue;
            }
            for (int64_t g = 0; g < G; ++g) {
              const int64_t m0 = r0 + g * (MB / G) + std::min(g, MB % G);
              const int rows = static_cast<int>(MB / G + (g < MB % G ? 1 : 0));
              f.dot(rows)(wn, nb, a, m0, res16);
              put(n, m0, rows, res16);
            }
          }
        }
        continue;
      }
      for (int64_t g = 0; g < ngroups; ++g) {
        const int64_t m0 = group_start(M, g);
        const int rows = static_cast<int>(group_start(M, g + 1) - m0);
        const DotFn fn = f.dot(rows);
        const Dot2Fn fn2 = f.dot2 ? f.dot2(rows) : nullptr;
        auto store = [&](int64_t n, const float* v) {
          for (int r = 0; r < rows; ++r) {
            const float o = bp ? v[r] + bp[n] : v[r];
            if (out_bf16) yb[(m0 + r) * N + n] = static_cast<at::BFloat16>(o);
            else yf[(m0 + r) * N + n] = o;
          }
        };
        for (int64_t n = n0; n < n1;) {
          const uint8_t* wn = wbase + (n - starts[s]) * row_bytes;
          if (fn2 != nullptr && n + 1 < n1) {
            const uint8_t* pair[2] = {wn, wn + row_bytes};
            fn2(pair, nb, a, m0, res);
            store(n, res);
            store(n + 1, res + rows);
            n += 2;
          } else {
            fn(wn, nb, a, m0, res);
            store(n, res);
            n += 1;
          }
        }
      }
    }
#if defined(SPECDEC_AMX)
    if (amx) _tile_release();
#endif
  });
  return y;
}

// Quantized activations as the kernels see them (for tests): q int8 [M, K], sums int16 [M, K/16], d [M, K/bs].
std::vector<at::Tensor> quantize_acts(at::Tensor x, int64_t bs) {
  TORCH_CHECK(x.dim() == 2 && (bs == 32 || bs == 256) && x.size(1) % bs == 0, "quantize_acts: bad shape");
  x = x.contiguous();
  Acts a;
  quantize_rows(x, bs, a);
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  auto d = at::empty({M, K / bs}, x.options().dtype(at::kFloat));
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(s.data_ptr<int16_t>(), a.s.data(), a.s.size() * 2);
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * 4);
  return {q, s, d};
}

}  // namespace SPECDEC_QLIB
