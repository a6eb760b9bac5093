"""The row-invariant int8 CPU kernel (specdec.kernels.int8_gemm): accuracy, row invariance, dtypes."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.kernels import int8_gemm

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the int8 kernel cannot be built (int8_linear falls back)", allow_module_level=True)
if not int8_gemm.available():
    pytest.skip(f"int8 kernel unavailable: {int8_gemm.unavailable_reason()}", allow_module_level=True)


def _weights(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) * 0.02 + 1e-4).to(torch.bfloat16)
    return q, s


def _x(M: int, K: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :: max(1, K // 7)] *= 50  # a few outlier channels, as in real activations
    return x.to(dtype)


def _reference(x, q, s):
    return x.double() @ (q.double() * s.double()[:, None]).T


@pytest.mark.parametrize(
    "M,N,K",
    [(1, 1, 1), (1, 3, 7), (2, 5, 8), (3, 17, 31), (5, 33, 33), (6, 64, 65), (7, 127, 250), (9, 61, 1537),
     (13, 255, 96), (33, 45, 129), (64, 7, 300), (100, 131, 257), (130, 19, 23)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(M, N, K, dtype):
    q, s = _weights(N, K, seed=M * 1000 + N)
    x = _x(M, K, seed=K, dtype=dtype)
    y = int8_gemm.int8_linear(x, q, s)
    assert y.dtype == dtype and y.shape == (M, N)
    ref = _reference(x, q, s)
    bound = x.double().abs() @ (q.double().abs() * s.double()[:, None]).T  # sum |x w|
    tol = 2e-6 * bound + 1e-30  # fp32 accumulation of <= ~1.5k terms
    if dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8  # + rounding of the output to bf16 (half an ulp is 2^-9 rel.)
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


def test_leading_dims_and_fp16():
    q, s = _weights(40, 72, seed=1)
    x = _x(6, 72, seed=2).view(2, 3, 72)
    y = int8_gemm.int8_linear(x, q, s)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.view(6, 40), int8_gemm.int8_linear(x.reshape(6, 72), q, s))
    yh = int8_gemm.int8_linear(x.half(), q, s)
    assert yh.dtype == torch.float16
    torch.testing.assert_close(yh.float(), y.float(), rtol=1e-2, atol=1e-2)


def test_non_contiguous_input():
    q, s = _weights(24, 40, seed=3)
    x = _x(40, 9, seed=4).T  # [9, 40] non-contiguous
    assert torch.equal(int8_gemm.int8_linear(x, q, s), int8_gemm.int8_linear(x.contiguous(), q, s))


ROWS = [1, 2, 3, 5, 6, 8, 9, 13, 16, 17, 33, 64, 100]
SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (37, 45), (131, 1537), (9, 5)]


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_invariance(N, K, dtype):
    """Row m of the output is bit-identical to the row computed alone, for any M and any position."""
    if dtype == torch.float32 and N * K > 4_000_000:
        pytest.skip("fp32 path checked on the smaller shapes (same kernel after conversion)")
    q, s = _weights(N, K, seed=N + K)
    pool = _x(max(ROWS), K, seed=7, dtype=dtype)
    alone = torch.cat([int8_gemm.int8_linear(pool[i : i + 1], q, s) for i in range(len(pool))])
    for M in ROWS:
        # first M rows, in order
        assert torch.equal(int8_gemm.int8_linear(pool[:M], q, s), alone[:M]), f"M={M}"
        # the same rows in another order and at other positions (first, last, inside a partial group)
        perm = torch.randperm(len(pool), generator=torch.Generator().manual_seed(M))[:M]
        assert torch.equal(int8_gemm.int8_linear(pool[perm], q, s), alone[perm]), f"M={M} permuted"
    # one row amid very different rows (zeros, huge values)
    for M in (2, 7, 13):
        other = torch.zeros(M, K, dtype=dtype)
        other[::2] = 1e4
        for pos in (0, M // 2, M - 1):
            xm = other.clone()
            xm[pos] = pool[3]
            assert torch.equal(int8_gemm.int8_linear(xm, q, s)[pos], alone[3]), f"M={M} pos={pos}"


def test_thread_count_does_not_change_bits():
    q, s = _weights(300, 200, seed=5)
    x = _x(11, 200, seed=6)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = int8_gemm.int8_linear(x, q, s)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(y1, int8_gemm.int8_linear(x, q, s))
