"""Layers whose weights stay in a GGUF's quantized blocks (run by `specdec.kernels.qgemm`).

`QuantLinear` holds one or more weight matrices of the same input size as uint8 `[N_i, row_bytes]` views
of the file (no copy: the GGUF is memory-mapped) and computes them in one call, so Q, K and V (or gate
and up) read the activations once and quantize them once. `QuantEmbedding` dequantizes only the rows it
looks up. Weights in types the kernels do not run (Q4_1, Q5_1, the other k-quants, F16/BF16/F32
matrices) are requantized once to Q8_0 at load; a model can also have every matrix requantized to Q8_0 or
Q4_0 (`load_quantized` methods `q8_0`, `q4_0`: a smaller, faster draft). On the AVX2 build Q5_0 matrices
are widened to Q8_0 copies at load (`qgemm.widens_q5_0`: the same bits, 1.55x their bytes, the 0.5B draft
~1.19x faster to decode).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from specdec.kernels.qgemm import (Q4_0, Q4_K, Q5_0, SUPPORTED_TYPES, X16_TYPES, interleaved_types, qmm, quantize_q4_0,
                                   quantize_q8_0, repack_x16, requantize_q4_0, widen_q5_0, widens_q5_0)
from specdec.models.dequant import dequantize_rows

Q8_0 = int(GGMLQuantizationType.Q8_0)


def kernel_blocks(blocks: torch.Tensor, qtype: int, row_len: int,
                  requantize: int | None = None) -> tuple[torch.Tensor, int]:
    """(blocks, type) the kernels can run: the file's own when its type is supported and no other type is
    asked for, else the dequantized rows requantized to `requantize` (default Q8_0). With Q4_0, blocks of
    no more bits than Q4_0 (Q4_0, Q4_K: 4.5 a weight) stay as they are: a smaller model, never a larger one.
    blocks: uint8 [N, row_bytes]."""
    if requantize not in (None, Q8_0, Q4_0):
        raise ValueError(f"blocks are requantized to Q8_0 or Q4_0, not type {requantize}")
    if qtype == requantize or (requantize is None and qtype in SUPPORTED_TYPES):
        return blocks, qtype
    if requantize == Q4_0:
        if qtype == Q4_K:
            return blocks, qtype
        if qtype in (Q8_0, Q5_0):  # straight from the blocks, in C++ (a 136M-value output layer: ~0.3 s)
            return requantize_q4_0(blocks, qtype), Q4_0
        return quantize_q4_0(dequantize_rows(blocks, qtype, row_len)), Q4_0
    return quantize_q8_0(dequantize_rows(blocks, qtype, row_len)), Q8_0


def row_bytes(qtype: int, row_len: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if row_len % block_size:
        raise ValueError(f"rows of {row_len} values do not fill {GGMLQuantizationType(qtype).name} blocks")
    return row_len // block_size * type_size


class QuantLinear(nn.Module):
    """y = x @ concat(W_0, W_1, ...).T + bias, each W_i in GGUF blocks; x bf16 or fp32, y in x's dtype."""

    def __init__(self, parts: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        for i, (w, t) in enumerate(parts):
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes(t, in_features):
                raise ValueError(f"part {i}: expected uint8 [N, {row_bytes(t, in_features)}] blocks, got {w.dtype} {list(w.shape)}")
            if t not in SUPPORTED_TYPES:
                raise ValueError(f"part {i}: the kernels do not run type {t}; use kernel_blocks() first")
        if widens_q5_0():  # Q5_0 as Q8_0: the same bits, faster where unpacking the fifth bits binds
            parts = [(widen_q5_0(w), Q8_0) if int(t) == Q5_0 else (w, t) for w, t in parts]
        self.in_features = in_features
        self.types = [int(t) for _, t in parts]
        self.sizes = [int(w.shape[0]) for w, _ in parts]
        self.out_features = sum(self.sizes)
        for i, (w, _) in enumerate(parts):
            self.register_buffer(f"blocks_{i}", w.contiguous(), persistent=False)
        # what the kernels read: Q4_K / Q6_K / Q4_0 / Q5_0 parts 16 channels interleaved where that build runs
        # them faster (the same bits); `blocks` (the file's, or a widened part's Q8_0 copy) stay for
        # select_rows / dequantize_rows
        self.kernel_types = list(self.types)
        self._kernel_buffers = [f"blocks_{i}" for i in range(len(parts))]
        interleave = interleaved_types()
        for i, (w, t) in enumerate(parts):
            if t in interleave and w.shape[0] % 16 == 0:
                self.register_buffer(f"kblocks_{i}", repack_x16(w, t), persistent=False)
                self.kernel_types[i], self._kernel_buffers[i] = X16_TYPES[t], f"kblocks_{i}"
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(), persistent=False)

    @property
    def blocks(self) -> list[torch.Tensor]:
        return [getattr(self, f"blocks_{i}") for i in range(len(self.types))]

    @property
    def kernel_blocks(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._kernel_buffers]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return qmm(x, self.kernel_blocks, self.kernel_types, self.bias, out_dtype=out_dtype)

    def select_rows(self, ids: torch.Tensor) -> "QuantLinear":
        """A new layer computing only output rows `ids` (sorted, of the whole concatenated weight), in that
        order: their blocks copied, the same types, so each row's bits are the same as here."""
        parts, start = [], 0
        for w, t, n in zip(self.blocks, self.types, self.sizes):
            sel = ids[(ids >= start) & (ids < start + n)] - start
            if len(sel):
                parts.append((w[sel].contiguous(), t))
            start += n
        bias = None if self.bias is None else self.bias[ids]
        return QuantLinear(parts, self.in_features, bias)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows `ids` of the whole (concatenated) weight as float32 [len(ids), in_features]."""
        out = torch.empty(len(ids), self.in_features)
        start = 0
        for w, t, n in zip(self.blocks, self.types, self.sizes):
            sel = (ids >= start) & (ids < start + n)
            if sel.any():
                out[sel] = dequantize_rows(w[ids[sel] - start], t, self.in_features)
            start += n
        return out

    def extra_repr(self) -> str:
        types = ", ".join(SUPPORTED_TYPES[t] for t in self.types)
        return f"in_features={self.in_features}, out_features={self.sizes}, types=[{types}], bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """Embedding rows looked up in GGUF blocks and dequantized (to `dtype`) only for the tokens asked."""

    def __init__(self, blocks: torch.Tensor, qtype: int, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim, self.dtype = int(qtype), num_embeddings, embedding_dim, dtype
        if blocks.shape != (num_embeddings, row_bytes(qtype, embedding_dim)):
            raise ValueError(f"embedding blocks of shape {list(blocks.shape)} do not hold {num_embeddings} x {embedding_dim}")
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.blocks[ids.reshape(-1)], self.qtype, self.embedding_dim)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.blocks[ids], self.qtype, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={GGMLQuantizationType(self.qtype).name}"
