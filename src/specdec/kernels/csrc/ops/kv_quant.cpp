// The Q8_0 encoding of K/V cache rows (kv_quant.h) as an op: what the Python writes and the tests call.
#include "../ops.h"
#include "kv_quant.h"

namespace SPECDEC_QLIB {

// x [..., D] (fp32 or bf16, D a multiple of 32) -> int8 [..., D + D / 16]: each row's Q8_0 bytes
at::Tensor quantize_kv(at::Tensor x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kQ8Block == 0, "quantize_kv: rows of a multiple of 32 values");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quantize_kv: fp32 or bf16");
  const int64_t D = x.size(-1), n = x.numel() / D;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = q8_row_bytes(D);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kChar));
  const float* src = xf.data_ptr<float>();
  char* dst = reinterpret_cast<char*>(out.data_ptr<int8_t>());
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) q8_encode(src + r * D, D, dst + r * q8_row_bytes(D));
  });
  return out;
}

}  // namespace SPECDEC_QLIB
