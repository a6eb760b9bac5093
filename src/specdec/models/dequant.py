"""GGUF tensor data -> float32 torch tensors, vectorized over blocks.

A quantized GGUF tensor is a run of fixed-size blocks; each block holds `block_size` weights as small
integers plus one or more fp16 scales. We reinterpret the bytes as a `[n_blocks, type_size]` uint8 tensor
and unpack every block at once with shifts and masks: no Python loop per block. The arithmetic is done in
float32 in the same order as ggml's reference (`gguf.quants`), so results agree bit for bit.

Worked example (Q8_0, 32 weights per block, 34 bytes): bytes `[0x00, 0x3C, 0x01, 0xFF, ...]` hold the fp16
scale 0x3C00 = 1.0 followed by int8 quants 1, -1, ...; the weights are 1.0 * 1 = 1.0, 1.0 * -1 = -1.0, ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # weights per super-block of the k-quants


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 stored as bytes `[n, 2]` -> float32 `[n, 1]`."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Split bytes into low then high nibbles, per group of `width` bytes.

    qs: [n, groups * width] uint8 -> [n, groups * 2 * width] uint8; group g gives its `width` low nibbles
    then its `width` high nibbles. Example, width 2: [0x21, 0x43] -> [1, 3, 2, 4].
    """
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _bits(b: torch.Tensor, width: int, nbits: int) -> torch.Tensor:
    """Unpack `nbits`-bit fields, lowest first, per group of `width` bytes.

    b: [n, groups * width] uint8 -> [n, groups * (8 // nbits) * width]. Example, width 1, nbits 2:
    [0b11100100] -> [0, 1, 2, 3].
    """
    n = b.shape[0]
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return ((b.reshape(n, -1, 1, width) >> shifts) & ((1 << nbits) - 1)).reshape(n, -1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    return d * (_nibbles(qs, 16).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:]
    return d * _nibbles(qs, 16).float() + m


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants of a 32-weight block: low nibbles from qs [n, 16], bit 4 from qh [n, 4] (bit i -> weight i)."""
    return _nibbles(qs, 16) | (_bits(qh, 1, 1) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _f16(blocks[:, :2]), blocks[:, 2:6], blocks[:, 6:]
    return d * (_q5(qh, qs).to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:8], blocks[:, 8:]
    return d * _q5(qh, qs).float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    return qs.contiguous().view(torch.int8).float() * d


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K super-block, packed in 12 bytes.

    scales: [n, 12] -> (sc [n, 8], mn [n, 8]). Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7
    mins 0-3; scales/mins 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the top
    2 bits of bytes 0-3 / 4-7.
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: weight = d * sc[j] * q - dmin * mn[j] for sub-block j (8 of 32 weights). q: [n, 8, 32]."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    return (scale * q.float() - offset).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    return _k_affine(blocks, _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    q = _nibbles(qs, 32).reshape(n, 8, 32) | (_bits(qh, 32, 1).reshape(n, 8, 32) << 4)
    return _k_affine(blocks, q)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 256 weights = 16 sub-blocks of 16, each with an int8 scale; 4 low bits in ql, 2 high in qh."""
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = _bits(qh, 32, 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    scale = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (scale * q.float()).reshape(n, QK_K)


_BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
_PLAIN = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED_TYPES = tuple(_PLAIN) + tuple(_BLOCK_KERNELS)


def dequantize(raw: np.ndarray, qtype: int | GGMLQuantizationType, shape: Sequence[int]) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32.

    raw: the tensor's data as `gguf.GGUFReader` gives it (`ReaderTensor.data`, any dtype; only its bytes
    are read). shape: the torch (row-major) shape, i.e. the GGUF dims reversed: a GGUF `[in, out]`
    weight is torch `[out, in]`. Returns a new float32 tensor of that shape.
    """
    qtype = GGMLQuantizationType(qtype)
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())  # [n_bytes]
    numel = int(np.prod(shape, dtype=np.int64))
    if qtype in _PLAIN:
        out = data.view(_PLAIN[qtype]).float()
    elif qtype in _BLOCK_KERNELS:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if numel % block_size or data.numel() != numel // block_size * type_size:
            raise ValueError(f"{qtype.name} tensor of shape {list(shape)} cannot hold {data.numel()} bytes")
        out = _BLOCK_KERNELS[qtype](data.reshape(-1, type_size))  # [n_blocks, block_size]
    else:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise NotImplementedError(f"GGUF tensor type {qtype.name} is not supported; specdec reads {names}")
    if out.numel() != numel:
        raise ValueError(f"{qtype.name} tensor of shape {list(shape)} has {out.numel()} values")
    return out.reshape(*shape)


def dequantize_rows(blocks: torch.Tensor, qtype: int | GGMLQuantizationType, row_len: int) -> torch.Tensor:
    """Rows of a GGUF matrix as float32: blocks uint8 [n, row_bytes] (whole rows of blocks) -> [n, row_len].

    Example: the embeddings of tokens `ids` are `dequantize_rows(table[ids], Q4_K, hidden)`.
    """
    qtype = GGMLQuantizationType(qtype)
    n = blocks.shape[0]
    if qtype in _PLAIN:
        return blocks.contiguous().view(_PLAIN[qtype]).float().reshape(n, row_len)
    if qtype not in _BLOCK_KERNELS:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise NotImplementedError(f"GGUF tensor type {qtype.name} is not supported; specdec reads {names}")
    _, type_size = GGML_QUANT_SIZES[qtype]
    return _BLOCK_KERNELS[qtype](blocks.reshape(-1, type_size)).reshape(n, row_len)
