// Q8_0 rows of the K/V cache (`--kv-cache-dtype q8_0`, llama.cpp's `-ctk q8_0`): 136 bytes where a bf16 row of
// 128 values takes 256, so 1.9x the tokens in the same memory (reading them back costs some speed). A row of D values (D a multiple of 32) is D int8, then D / 32
// fp16 scales: for each 32 values, d = fp16(max |x| / 127) (to nearest even) and q = x * (1 / d) rounded to
// nearest even, clamped to +-127 (q = 0 where d = 0). A value reads back as q * d, exact in fp32. Each token's
// row is encoded alone, so a token's bytes do not depend on the pass that wrote it (`q8_encode` in Python
// computes the same IEEE operations: tests/test_attention.py compares them bit for bit).
#pragma once
#include "../arch/kv_quant.h"

namespace SPECDEC_QLIB {
namespace {

constexpr int64_t kQ8Block = 32;

inline int64_t q8_row_bytes(int64_t D) { return D + D / kQ8Block * 2; }

inline void q8_encode(const float* x, int64_t D, char* row) {
  int8_t* q = reinterpret_cast<int8_t*>(row);
  for (int64_t b = 0; b < D / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const c10::Half d(amax / 127.0f);
    const float df = static_cast<float>(d), id = df != 0.f ? 1.0f / df : 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i)
      q[b * kQ8Block + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * id))));
    const uint16_t bits = d.x;
    std::memcpy(row + D + 2 * b, &bits, 2);
  }
}

// a block's 32 values q * d, 16 (AVX-512) or 8 (AVX2) at a time (arch/kv_quant.h), else one by one: the same
// products
inline void q8_block_f32(const int8_t* q, float d, float* out) {
  int64_t i = q8_block_f32_vec(q, d, out, kQ8Block);
  for (; i < kQ8Block; ++i) out[i] = static_cast<float>(q[i]) * d;
}

inline float q8_scale(const char* row, int64_t D, int64_t b) {
  return fp16(reinterpret_cast<const uint8_t*>(row + D + 2 * b));
}

inline void q8_to_f32(const char* row, float* out, int64_t D) {
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (int64_t b = 0; b < D / kQ8Block; ++b) q8_block_f32(q + b * kQ8Block, q8_scale(row, D, b), out + b * kQ8Block);
}

// q * d rounded to bf16 (to nearest even): what the tile unit reads
inline void q8_to_bf16(const char* row, uint16_t* out, int64_t D) {
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (int64_t b = 0; b < D / kQ8Block; ++b) {
    const float d = q8_scale(row, D, b);
    if (q8_block_bf16_vec(q + b * kQ8Block, d, out + b * kQ8Block, kQ8Block) == kQ8Block) continue;  // AVX-512 BF16
    alignas(64) float f[kQ8Block];
    q8_block_f32(q + b * kQ8Block, d, f);
    for (int64_t i = 0; i < kQ8Block; ++i) {
      uint32_t u;
      std::memcpy(&u, f + i, 4);
      out[b * kQ8Block + i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
}

}  // namespace
}  // namespace SPECDEC_QLIB
