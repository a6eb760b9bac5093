// The ops of one build of the kernels (torch.ops.<SPECDEC_QLIB>.<op>, registered in registration.cpp), each
// defined in the file named beside it. Every file of csrc/ is compiled once per instruction set, with
// -DSPECDEC_QLIB=specdec_qgemm_<isa>: the library's name and the C++ namespace of its symbols, so that the
// four builds loaded into one process never share a symbol.
#pragma once

#include <torch/library.h>

#include <vector>

#ifndef SPECDEC_QLIB
#define SPECDEC_QLIB specdec_qgemm
#endif

namespace SPECDEC_QLIB {

// qmm.cpp: the matmul on GGUF blocks, and the activations as it quantizes them (for tests)
at::Tensor qmm(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> types, c10::optional<at::Tensor> bias,
               c10::optional<at::ScalarType> out_dtype = c10::nullopt);
std::vector<at::Tensor> quantize_acts(at::Tensor x, int64_t bs);
std::vector<int64_t> formats();  // the block formats' table, 4 numbers an entry (formats.h)
bool uses_tiles();
void set_pair_rows(int64_t mask);
int64_t pair_rows();
void set_wide_rows(int64_t rows);
int64_t wide_rows();
// repack/: the 16-channel layouts; quant/q32.h: a Q8_0 copy of Q5_0 blocks, a Q4_0 copy of Q8_0 / Q5_0 blocks
at::Tensor repack_q4k_x16(at::Tensor w);
at::Tensor repack_q6k_x16(at::Tensor w);
at::Tensor repack_q40_x16(at::Tensor w);
at::Tensor repack_q50_x16(at::Tensor w);
at::Tensor widen_q50_q80(at::Tensor w);
at::Tensor requantize_q4_0(at::Tensor w, int64_t type);
// ops/
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                     c10::optional<at::Tensor> key_index, c10::optional<at::Tensor> pages);
bool attention_tiles(int64_t head_dim);
at::Tensor quantize_kv(at::Tensor x);  // ops/kv_quant.cpp: K/V rows in Q8_0 (--kv-cache-dtype q8_0)
at::Tensor decoder_layer(at::Tensor x, std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> qkv_w,
                         std::vector<int64_t> qkv_t, c10::optional<at::Tensor> qkv_b, std::vector<at::Tensor> o_w,
                         std::vector<int64_t> o_t, std::vector<at::Tensor> gu_w, std::vector<int64_t> gu_t,
                         std::vector<at::Tensor> dn_w, std::vector<int64_t> dn_t, at::Tensor cos, at::Tensor sin,
                         at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor visible,
                         c10::optional<at::Tensor> key_index, int64_t H, int64_t KV, c10::optional<at::Tensor> pages,
                         c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, bool gelu,
                         double q_factor);

}  // namespace SPECDEC_QLIB
