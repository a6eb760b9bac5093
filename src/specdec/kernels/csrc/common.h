// Shared by every file of the kernels: includes, the row groups, fp16, the fp32 steps of the k-quants,
// prefetching.
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
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(SPECDEC_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef SPECDEC_QLIB
#define SPECDEC_QLIB specdec_qgemm
#endif

namespace SPECDEC_QLIB {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kMaxRows = 12;  // 32 vector registers: the k-quants' fixed lanes keep one a row (two trees: 8 and
                               // the rest); the 32-value types run a group of more than 8 rows as two
#else
constexpr int kMaxRows = 4;
#endif

// The rows of a call go in groups of at most kMaxRows, as even as can be (16 rows: 8 + 8, not 12 + 4; 9:
// 9): a group shares each weight block, and a large group's rows cost more each (registers run short).
inline int64_t row_groups(int64_t M) { return (M + kMaxRows - 1) / kMaxRows; }
inline int64_t group_start(int64_t M, int64_t g) {  // the first `M % groups` groups take one row more
  const int64_t G = row_groups(M);
  return g * (M / G) + std::min(g, M % G);
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

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
