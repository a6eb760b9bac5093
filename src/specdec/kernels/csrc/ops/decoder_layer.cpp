#include "../common.h"
#include "../ops.h"
#include "kv_quant.h"

#include <algorithm>

namespace SPECDEC_QLIB {
namespace {
// One dense decoder layer on the block kernels, as `models.llama.DecoderLayer` computes it (the same ops in
// the same order, so the same bits): x + attn(norm1(x)), then + mlp(norm2(.)), where attn is qkv -> rope(q),
// rope(k) -> k, v written to their cache slots -> attention -> o, and mlp is down(act(gate) * up).  One call a
// layer instead of some forty from Python.  weights: [qkv, o, gate_up, down] as segments of blocks with their
// types; slots [B, T]: the cache slot of each new token; pages: as `attention`'s.  What other families add
// (`specdec.architectures`): q_norm, k_norm: per-head norms of q and k before rope (Qwen3, Gemma 3);
// four norms, the sandwich x + norm2(attn(norm1(x))), then + norm4(mlp(norm3(.))) (Gemma 3); gelu: tanh-GELU
// for act (else SiLU); q_factor: q scaled after rope (a query scale other than head_dim's).
// The layer computes in x's dtype: fp32 keeps the residual stream, norms, rope and the matrices' outputs in fp32
// (as llama.cpp does), while the K/V cache keeps its own (bf16, or Q8_0 rows): the new K/V are rounded to it
// when written, q to it for attention, whose output comes back in x's dtype; gate and up are bf16 whatever x's.
void write_slots(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, const int64_t* pages, int64_t np) {
  // src [B, T, KV, D] rows; cache [pages, KV, P, D] (D: a row's elements, of src's dtype); slot s of row b:
  // page pages[b][s / P] (or b), row s % P
  const int64_t B = src.size(0), Tn = src.size(1), KV = src.size(2), D = src.size(3), P = cache.size(2);
  const int64_t esize = src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(cache.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t slot = slots[b * Tn + t];
      TORCH_CHECK(slot >= 0 && slot < np * P, "decoder_layer: slot ", slot, " outside the cache");
      const int64_t page = pages ? pages[b * np + slot / P] : b;
      for (int64_t g = 0; g < KV; ++g)
        std::memcpy(cp + (((page * KV + g) * P + slot % P) * D) * esize,
                    sp + (b * src.stride(0) + t * src.stride(1) + g * src.stride(2)) * esize, D * esize);
    }
}

}  // namespace

at::Tensor decoder_layer(at::Tensor x, std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> qkv_w,
                         std::vector<int64_t> qkv_t, c10::optional<at::Tensor> qkv_b, std::vector<at::Tensor> o_w,
                         std::vector<int64_t> o_t, std::vector<at::Tensor> gu_w, std::vector<int64_t> gu_t,
                         std::vector<at::Tensor> dn_w, std::vector<int64_t> dn_t, at::Tensor cos, at::Tensor sin,
                         at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor visible,
                         c10::optional<at::Tensor> key_index, int64_t H, int64_t KV, c10::optional<at::Tensor> pages,
                         c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, bool gelu,
                         double q_factor) {
  TORCH_CHECK(x.dim() == 3 && (norms.size() == 2 || norms.size() == 4) && cos.dim() == 3,
              "decoder_layer: x [B, T, hidden], two or four norms");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q_norm and k_norm go together");
  const bool sandwich = norms.size() == 4;
  const int64_t B = x.size(0), Tn = x.size(1), Hd = x.size(2), D = cos.size(2);
  const bool q8 = k_cache.scalar_type() == at::kChar;  // Q8_0 rows (kv_quant.h): the new K/V encoded, then written
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == KV &&
              k_cache.size(3) == (q8 ? q8_row_bytes(D) : D) && v_cache.sizes() == k_cache.sizes(),
              "decoder_layer: cache shapes");
  slots = slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B * Tn, "decoder_layer: slots int64 [B, T]");
  at::Tensor table;  // checked by `attention` (which runs before any slot is read, after they are written)
  if (pages.has_value()) {
    table = pages->contiguous();
    TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == at::kLong,
                "decoder_layer: pages [B, pages a sequence] int64");
    const int64_t* t = table.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(t, t + table.numel(), [&](int64_t p) { return p >= 0 && p < k_cache.size(0); }),
                "decoder_layer: a page outside the cache");
  } else {
    TORCH_CHECK(k_cache.size(0) >= B, "decoder_layer: fewer cache rows than sequences");
  }
  const int64_t* page_ptr = pages.has_value() ? table.data_ptr<int64_t>() : nullptr;
  const int64_t np = pages.has_value() ? table.size(1) : 1;
  const auto dtype = x.scalar_type();
  const auto as_x = [&](const at::Tensor& t) { return t.scalar_type() == dtype ? t : t.to(dtype); };
  for (auto& w : norms) w = as_x(w);
  if (q_norm.has_value()) {
    q_norm = as_x(*q_norm);
    k_norm = as_x(*k_norm);
  }
  cos = as_x(cos);
  sin = as_x(sin);
  const auto as_cache = [&](const at::Tensor& t) {  // rows as the cache holds them (Q8_0: encoded from t)
    if (q8) return quantize_kv(t);
    return t.scalar_type() == k_cache.scalar_type() ? t : t.to(k_cache.scalar_type());
  };
  const at::Tensor h = rms_norm(x, norms[0], eps);
  const at::Tensor qkv = qmm(h.view({B * Tn, Hd}), qkv_w, qkv_t, qkv_b).view({B, Tn, (H + 2 * KV) * D});
  at::Tensor q = qkv.narrow(2, 0, H * D).view({B, Tn, H, D});
  at::Tensor k = qkv.narrow(2, H * D, KV * D).view({B, Tn, KV, D});
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, *k_norm, eps);
  }
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  if (q_factor != 1.0) q = at::mul(q, q_factor);
  const at::Tensor v = qkv.narrow(2, (H + KV) * D, KV * D).view({B, Tn, KV, D});
  write_slots(as_cache(k), k_cache, slots.data_ptr<int64_t>(), page_ptr, np);
  write_slots(as_cache(v), v_cache, slots.data_ptr<int64_t>(), page_ptr, np);
  const at::Tensor a = as_x(attention(q8 ? q : as_cache(q), k_cache, v_cache, visible, key_index, pages));
  at::Tensor o = qmm(a.view({B * Tn, H * D}), o_w, o_t, c10::nullopt).view({B, Tn, Hd});
  if (sandwich) o = rms_norm(o, norms[1], eps);
  const at::Tensor x1 = at::add(x, o);
  // gate and up in bf16 (as the cache: the MLP's widest tensors, whose product is rounded to 8 bits next), the
  // down projection's output in x's dtype
  const at::Tensor gu = qmm(rms_norm(x1, norms[sandwich ? 2 : 1], eps).view({B * Tn, Hd}), gu_w, gu_t, c10::nullopt,
                            at::kBFloat16);
  const int64_t I = gu.size(1) / 2;
  const at::Tensor gate = gu.narrow(1, 0, I);
  const at::Tensor act = at::mul(gelu ? at::gelu(gate, "tanh") : at::silu(gate), gu.narrow(1, I, I));
  at::Tensor m = qmm(act, dn_w, dn_t, c10::nullopt, dtype).view({B, Tn, Hd});
  if (sandwich) m = rms_norm(m, norms[3], eps);
  return at::add(x1, m);
}

}  // namespace SPECDEC_QLIB
