#include "../common.h"
#include "../ops.h"

namespace SPECDEC_QLIB {
namespace {
// Rotary embedding, rotate-half layout: y = x * cos + rotate_half(x) * sin, each product and the sum
// rounded to x's dtype as the float path rounds them. x: [B, T, heads, D] (any strides), cos/sin:
// [B, T, D] contiguous. Returns a contiguous [B, T, heads, D].
template <typename T>
void rope_rows(const at::Tensor& x, const T* cs, const T* sn, T* y) {
  const int64_t B = x.size(0), Tn = x.size(1), Hn = x.size(2), D = x.size(3), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2), sd = x.stride(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const T* c = cs + (b * Tn + t) * D;
      const T* s = sn + (b * Tn + t) * D;
      for (int64_t h = 0; h < Hn; ++h) {
        const T* xr = xp + b * sb + t * st + h * sh;
        T* yr = y + ((b * Tn + t) * Hn + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -f32(xr[(d + half) * sd]) : f32(xr[(d - half) * sd]);
          const T a = static_cast<T>(f32(xr[d * sd]) * f32(c[d]));
          const T bb = static_cast<T>(rot * f32(s[d]));
          yr[d] = static_cast<T>(f32(a) + f32(bb));
        }
      }
    }
}

}  // namespace

at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && x.device().is_cpu(), "rope: x [B, T, heads, D], cos/sin [B, T, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "rope: one dtype");
  TORCH_CHECK(x.size(3) % 2 == 0 && cos.size(2) == x.size(3), "rope: head_dim mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto y = at::empty({x.size(0), x.size(1), x.size(2), x.size(3)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    rope_rows<at::BFloat16>(x, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "rope: bf16 or fp32");
  return y;
}

}  // namespace SPECDEC_QLIB
