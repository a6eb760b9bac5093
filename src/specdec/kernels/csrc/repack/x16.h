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

}  // namespace
}  // namespace SPECDEC_QLIB
