"""Our torch dequantization equals gguf's numpy reference bit for bit, for every type we read.

A small GGUF is written with `gguf.GGUFWriter`: types gguf can quantize are quantized from random floats;
the k-quants (which gguf can only dequantize) are random raw blocks with finite fp16 scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFWriter, quants

from specdec.models.dequant import SUPPORTED_TYPES, dequantize

QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Byte offsets of the fp16 scales inside one block of the types built from raw bytes.
RAW_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
SHAPE = (6, 512)  # torch [out, in]; `in` is a multiple of every block size


def _raw_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes `[rows, bytes_per_row]` whose fp16 scales are finite (random bytes may be NaN)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for off in RAW_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dq") / "types.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    for qtype in QUANTIZABLE:
        data = rng.standard_normal(SHAPE).astype(np.float32)
        writer.add_tensor(qtype.name, quants.quantize(data, qtype), raw_dtype=qtype)
    for qtype in RAW_SCALE_OFFSETS:
        writer.add_tensor(qtype.name, _raw_blocks(qtype, *SHAPE, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_supported_type_is_covered():
    assert set(SUPPORTED_TYPES) == set(QUANTIZABLE) | set(RAW_SCALE_OFFSETS)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_bit_exact_against_gguf_reference(gguf_file, qtype):
    tensor = next(t for t in GGUFReader(gguf_file).tensors if t.name == qtype.name)
    torch_shape = tuple(int(d) for d in reversed(tensor.shape))
    assert torch_shape == SHAPE

    ours = dequantize(tensor.data, tensor.tensor_type, torch_shape)
    reference = torch.from_numpy(quants.dequantize(tensor.data, qtype).astype(np.float32).reshape(SHAPE))

    assert ours.dtype == torch.float32 and ours.shape == SHAPE
    assert torch.isfinite(ours).all()
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))  # bit for bit


def test_q8_0_worked_example():
    block = np.zeros(34, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    assert dequantize(block, T.Q8_0, (32,)).tolist() == list(range(-16, 16))


def test_wrong_size_and_unsupported_type_are_clear_errors():
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize(np.zeros(33, dtype=np.uint8), T.Q8_0, (32,))
    with pytest.raises(NotImplementedError, match="Q2_K is not supported"):
        dequantize(np.zeros(84, dtype=np.uint8), T.Q2_K, (256,))
