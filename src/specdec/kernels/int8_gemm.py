"""Row-invariant weight-only int8 GEMM for AVX2/FMA CPUs: y = x @ (qweight * scale[:, None]).T.

The C++ kernel (csrc/int8/int8_gemm.cpp) is built at install (`specdec.kernels.native`; in a developer's checkout
whose C++ differs, on first use).  Its cost is nearly flat in the number of rows for small M (the int8
weight stream is converted once per group of up to 6 rows), and row m of the output is bit-identical whatever the other rows are and however many there
are, which keeps speculative verification bit-identical to plain decoding.

If the library cannot be loaded (no AVX2/FMA, not built), `int8_linear` falls back to
torch's `_weight_int8pack_mm` and warns once; `available()` says which path is in use.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from specdec.kernels import native

_lock = threading.Lock()
_module = None
_error: str | None = None
_warned = False


def _load():
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("SPECDEC_DISABLE_INT8_KERNEL"):
            _error = "disabled by SPECDEC_DISABLE_INT8_KERNEL"
            return None
        if not native.runs_isa("avx2"):
            _error = "this CPU lacks AVX2/FMA/F16C"
            return None
        try:
            _module = native.load_ops("specdec_int8")  # torch.ops.specdec_int8.int8_mm
        except Exception as exc:  # not installed and no compiler, a build error ...
            _error = f"{type(exc).__name__}: {exc}"
            _module = None
    return _module


def available() -> bool:
    """True when the custom kernel is installed (or, in a developer's checkout, can be built) and loads."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y[..., N] = x[..., K] @ (qweight[N, K].float() * scale[N, None]).T, in x's dtype (bf16 or fp32).

    Accumulates in fp32 in a fixed order per (row, channel): row results do not depend on the other rows.
    """
    mod = _load()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if mod is None or x.device.type != "cpu":
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(
                f"specdec int8 kernel unavailable ({_error or 'non-CPU tensor'}); "
                "falling back to torch's _weight_int8pack_mm (not row-invariant)",
                RuntimeWarning,
                stacklevel=2,
            )
        y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scale.to(x.dtype))
    elif x.dtype in (torch.bfloat16, torch.float32):
        y = mod.int8_mm(x2, qweight, scale)
    else:
        y = mod.int8_mm(x2.float(), qweight, scale).to(x.dtype)
    return y.view(*shape[:-1], qweight.shape[0])
