// Shared by every file of the kernels: includes, the fp32 steps of the k-quants, prefetching. (What depends on
// the instruction set, the row groups and fp16 included, is the vector layer's: isa/vec.h.)
#pragma once

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef SPECDEC_QLIB
#define SPECDEC_QLIB specdec_qgemm
#endif

namespace SPECDEC_QLIB {
namespace {

// One k-quant block's fp32 step for a (row, channel), from its exact integers; every path of every build
// computes exactly these operations (vectorized ones lane by lane): f + (S * (dx d) - Mn * (dx dmin)), the
// product with S fused (Q4_K / Q5_K), and f + S * (dx d), fused (Q6_K).
inline float step45(float f, int32_t S, int32_t Mn, float dx, float d, float dmin) {
  return f + std::fma(static_cast<float>(S), dx * d, -(static_cast<float>(Mn) * (dx * dmin)));
}
inline float step6(float f, int32_t S, float dx, float d) { return std::fma(static_cast<float>(S), dx * d, f); }

// Two sub-block sums (each fits 16 bits) as one int32: lo in the low half, hi in the high half, the layout
// `madd_epi16` / the tiles read them in.
inline int32_t pack_i16x2(int32_t lo, int32_t hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) | (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

// Weights are read front to back, row after row of a tile; each block read also asks for the bytes
// kAhead further on (the rows after), so that they come from memory while this block is computed. The
// hardware prefetchers alone (they stop at page boundaries and ramp up anew) left the default target's
// one-token step at 82 ms instead of 62 (`benchmarks/bench_kernels.py`).
constexpr int64_t kAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, int64_t n) {
  for (int64_t l = 0; l < n; l += 64) __builtin_prefetch(p + kAhead + l, 0, 3);
}

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

}  // namespace
}  // namespace SPECDEC_QLIB
