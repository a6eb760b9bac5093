"""Custom CPU kernels (built at install: `specdec.kernels.native`)."""

from specdec.kernels.int8_gemm import available, int8_linear

__all__ = ["available", "int8_linear"]
