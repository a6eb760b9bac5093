// Attention over the K/V cache on CPU (attention.cpp): the op the block kernels' library registers as
// `attention` and the fused `decoder_layer` calls.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace specdec {

// softmax(q . k / sqrt(D)) . v for each query over the keys it sees, exact and row-invariant.
// q: [B, T, H, D] (any strides), bf16 or fp32; keys, values: [rows >= B, KV, capacity, D] (the cache,
// contiguous, q's dtype); visible: [B, T, S] bool, key j of query (b, t) being cache slot j, or
// key_index[b, t, j] (int64 [B, T, S]) when given. Returns a contiguous [B, T, H, D] in q's dtype.
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                     c10::optional<at::Tensor> key_index);

}  // namespace specdec
