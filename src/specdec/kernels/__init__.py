"""Custom CPU kernels (compiled on first use)."""

from specdec.kernels.int8_gemm import available, int8_linear

__all__ = ["available", "int8_linear"]
