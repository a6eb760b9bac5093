// What the kernels know of a block format: one `Format` entry a type, defined in the type's own file
// (quant/, repack/) and listed once in formats.h; qmm reads nothing else about a type.
#pragma once
#include "acts.h"

namespace SPECDEC_QLIB {
namespace {

// One weight row (or block of 16 channels) times a group of R rows of activations: adds row r's dot
// product with weight row `w` (nb blocks) into out[r] (16 channels side by side: out[16 r + c]), a plain store.
using DotFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, float*);
// Two weight rows at a time (w[0], w[1]) for one or two rows: out[r] and out[rows + r].
using Dot2Fn = void (*)(const uint8_t* const*, int64_t, const Acts&, int64_t, float*);
// Many rows x one block of 16 channels (w, nb, acts, first row, rows, out[16 r + c]): `dot`'s bits for every row,
// the block's quants unpacked once for all the rows (wide_x16, repack/x16.h).
using WideFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, int64_t, float*);

// bit r - 1: groups of r rows (r = 1, 2) take the two-channel kernels where a type has them (the same bits
// as the one-channel ones; which is faster depends on the core: `set_pair_rows`, from the tuning file)
std::atomic<int> g_pair_rows{3};
inline bool pairs_for(int rows) { return (rows == 1 || rows == 2) && (g_pair_rows.load(std::memory_order_relaxed) >> (rows - 1) & 1); }

struct Format {
  int64_t type;      // GGML's type id (ggml.h), or one of the kernels' own layouts (GGML's id + 100)
  const char* name;
  int64_t values;    // weights a block: 32, or 256 (the k-quants: activations quantized per 256)
  int64_t bytes;     // bytes a block (a block of 16 channels for the interleaved layouts)
  int64_t channels;  // output channels a row of blocks holds: 1, or 16 (interleaved: groups of up to 4 rows)
  int orders;        // the activations' orders its 512-bit kernels read (kOrderQ45, kOrderQ6; acts.h)
  DotFn (*dot)(int rows);    // the kernel for a group of `rows` rows (1..kMaxRows; interleaved 1..4)
  Dot2Fn (*dot2)(int rows);  // two channels at a time, or nullptr (not offered, or not chosen for `rows`)
  WideFn wide = nullptr;     // a wide pass's rows (16-channel layouts), or nullptr: groups of `dot`
};

// A kernel family's `K::dot<R>()` for a run-time row count: R = 1 .. kMaxRows (the build's, isa/vec.h), else
// nullptr.
template <typename K, int... R>
DotFn by_rows_of(int rows, std::integer_sequence<int, R...>) {
  DotFn fn = nullptr;
  ((rows == R + 1 ? (fn = K::template dot<R + 1>(), 0) : 0), ...);
  return fn;
}
template <typename K>
DotFn by_rows(int rows) {
  return by_rows_of<K>(rows, std::make_integer_sequence<int, kMaxRows>());
}
// The 16-channel layouts' kernels: groups of 1 to 4 rows.
template <typename K>
DotFn by_rows4(int rows) {
  switch (rows) {
    case 1: return K::template dot<1>();
    case 2: return K::template dot<2>();
    case 3: return K::template dot<3>();
    default: return K::template dot<4>();
  }
}

}  // namespace
}  // namespace SPECDEC_QLIB
