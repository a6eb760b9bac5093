// The layouts of 16 channels side by side (repack/q*_x16.h): the kernels' own, made at load from the file's
// blocks (`repack_*_x16`), read by the 512-bit builds with the channels in the vector lanes.
#pragma once
#include "../format.h"
#include "../ops.h"

namespace SPECDEC_QLIB {
namespace {

// Each line of a block is asked for 32 KiB ahead into L2 (prefetcht2): this kernel consumes its stream about
// 2.5x as fast as the file-order ones, and asking into L1 4 KiB ahead left it waiting on memory (from a
// 116 MB matrix, one thread: 18.1 ns a block, 8.0 ns so; two threads 9.5 and 5.4 ns, about what a plain
// read of memory reached that hour)
constexpr int64_t kX16Ahead = 32768;

// A layout of 16 channels side by side: `fill(o, c, b)` writes channel c's share of an output block o from
// its file block b (`in` bytes), for every block of every 16 channels.
template <typename Fill>
at::Tensor repack_x16(const at::Tensor& w, const char* type, int64_t in, int64_t out_bytes, Fill fill) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "repack_x16: uint8 [N, row_bytes] blocks");
  const int64_t N = w.size(0), row = w.size(1), nb = row / in;
  TORCH_CHECK(N % 16 == 0 && row % in == 0, "repack_x16: N must be a multiple of 16 and rows whole ", type, " blocks");
  auto out = at::empty({N / 16, nb * out_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i = 0; i < nb; ++i)
        for (int c = 0; c < 16; ++c) fill(dst + (g * nb + i) * out_bytes, c, src + (g * 16 + c) * row + i * in);
  });
  return out;
}

// Wide passes (`wide_x16`): a block's quants as bytes, unpacked once for every group of rows, register u's
// low values (sub-blocks 0-7) at un + 128 u and its high ones at un + 128 u + 64, channel c's value 4u + t
// (or 128 + 4u + t) in byte 4c + t, as in the packed register.
constexpr int64_t kX16Unpacked = 32 * 128;
#if defined(SPECDEC_Z512)
struct X16Bytes {
  const uint8_t* un;
  void get(int u, __m512i& ql, __m512i& qh) const {
    ql = _mm512_load_si512(un + 128 * u);
    qh = _mm512_load_si512(un + 128 * u + 64);
  }
};
#elif defined(SPECDEC_AVX2)
struct X16Bytes {  // half h: channels 8h..8h + 7
  const uint8_t* un;
  void get(int u, int h, VI& ql, VI& qh) const {
    ql = load(un + 128 * u + 32 * h);
    qh = load(un + 128 * u + 64 + 32 * h);
  }
};
#endif

// Many rows (a block of up to kX16RowBlock, qmm.cpp) x 16 channels, for prompt chunks and wide passes: each weight
// block's quants are put into bytes once (`K::unpack(b, un)`), and every group of up to 4 rows reads those
// (`K::rows<R>(b, un, a, m, i, out)`) instead of joining their bits again (Q6_K: 10-12 vector operations a
// register, against 8 products for 4 rows). A (row, channel)'s fp32 value goes from out to out block after block, taking the steps of `dot`
// in the same order from the same integers: the same bits.
template <typename K>
void wide_x16(const uint8_t* w, int64_t nb, const Acts& a, int64_t m0, int64_t rows, float* out) {
  alignas(64) uint8_t un[kX16Unpacked];
  std::fill(out, out + 16 * rows, 0.f);
  const int64_t G = (rows + 3) / 4;  // groups as even as can be, as qmm makes them
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * K::kBytes;
    for (int64_t l = 0; l < K::kBytes; l += 64) __builtin_prefetch(b + kX16Ahead + l, 0, 1);
    K::unpack(b, un);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t mg = g * (rows / G) + std::min(g, rows % G);
      float* o = out + 16 * mg;
      switch (rows / G + (g < rows % G ? 1 : 0)) {
        case 1: K::template rows<1>(b, un, a, m0 + mg, i, o); break;
        case 2: K::template rows<2>(b, un, a, m0 + mg, i, o); break;
        case 3: K::template rows<3>(b, un, a, m0 + mg, i, o); break;
        default: K::template rows<4>(b, un, a, m0 + mg, i, o); break;
      }
    }
  }
}

}  // namespace
}  // namespace SPECDEC_QLIB
