"""Row-invariant weight-only int8 GEMM for AVX2/FMA CPUs: y = x @ (qweight * scale[:, None]).T.

The C++ kernel (int8_gemm.cpp) is compiled on first use with torch.utils.cpp_extension (cached under
the torch extensions dir, under a name holding a hash of the source, so edits rebuild).  Its cost is
nearly flat in the number of rows for small M (the int8 weight stream is converted once per group of up
to 6 rows), and row m of the output is bit-identical whatever the other rows are and however many there
are, which keeps speculative verification bit-identical to plain decoding.

If the extension cannot be built or loaded (no compiler, no AVX2/FMA), `int8_linear` falls back to
torch's `_weight_int8pack_mm` and warns once; `available()` says which path is in use.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from specdec.kernels.build import build_ops

_SOURCE = Path(__file__).with_name("int8_gemm.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_lock = threading.Lock()
_module = None
_error: str | None = None
_warned = False


def _cpu_supports_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma", "f16c"} <= flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


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
        if not _cpu_supports_avx2_fma():
            _error = "this CPU lacks AVX2/FMA/F16C"
            return None
        try:
            build_ops("specdec_int8_gemm", _SOURCE, _FLAGS)  # registers torch.ops.specdec_int8.int8_mm
            _module = torch.ops.specdec_int8
        except Exception as exc:  # no compiler, missing headers, build error ...
            _error = f"{type(exc).__name__}: {exc}"
            _module = None
    return _module


def available() -> bool:
    """True when the custom kernel is (or can be) compiled and loaded; triggers the build on first call."""
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
