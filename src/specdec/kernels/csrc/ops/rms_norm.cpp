// RMSNorm, one op (fewer dispatches per layer). Like every op of ops/: row by row in scalar code (no
// reassociation: -ffp-contract=off, no -ffast-math), so every build and any number of rows give the same bits.
#include "../common.h"
#include "../ops.h"

namespace SPECDEC_QLIB {
namespace {

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) per row of the last dimension (the RMSNorm of Llama/Qwen2,
// rounded as the float path rounds: the normalized row to x's dtype, then the product with w).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // 8 partial sums, then one fixed order
      for (int64_t i = 0; i < H; ++i) acc[i & 7] += f32(xr[i]) * f32(xr[i]);
      const float ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) y[r * H + i] = static_cast<T>(f32(w[i]) * f32(static_cast<T>(f32(xr[i]) * inv)));
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == w.scalar_type(), "rms_norm: CPU tensors of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.numel() == H, "rms_norm: weight must have ", H, " values");
  x = x.contiguous();
  w = w.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  const int64_t rows = H ? x.numel() / H : 0;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, H, eps);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, H, eps);
  return y;
}

}  // namespace SPECDEC_QLIB
