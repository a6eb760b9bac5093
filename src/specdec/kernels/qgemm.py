"""Matrix products on a GGUF's own quantized blocks (the C++ in csrc/: qmm.cpp and the files it names), and
the ops around them (csrc/ops/), built at install (`specdec.kernels.native`).

One build per instruction set, picked from the CPU's flags at run time:

- `avx512amx`: the `avx512vnni` kernels, and passes of 12 rows or more on k-quant weights multiplied on the
  AMX tile unit (Sapphire Rapids and later; used when the compiler knows AMX and the OS allows it);
- `avx512vnni`: AVX-512 BW/VNNI on 512-bit vectors, up to 12 rows per weight pass (k-quants in fixed lanes);
- `avx2`: AVX2 + FMA (the baseline of x86 CPUs since 2013), 4 rows per weight pass;
- `generic`: portable C++ that computes the same integers and fp32 steps in scalar code (correct, slower).

All of them give the same bits (the integers are exact and the fp32 steps are the same), and in each
the bits of an output row do not depend on the other rows, their number, or the thread count.
`SPECDEC_QGEMM_ISA` forces a build (tests use it to compare them).

Example: `qmm(x, [w_q, w_k, w_v], [12, 12, 14], bias)` -> x @ concat(w_q, w_k, w_v).T + bias, where each
w is the uint8 [N, row_bytes] view of a GGUF tensor and 12 / 14 are GGML's Q4_K / Q6_K type ids.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from specdec.kernels import native, tuning

logger = logging.getLogger(__name__)
_ISA_FLAGS = native.ISA_FLAGS  # the builds, fastest first
_ISA_CPU_FLAGS = native.ISA_CPU_FLAGS
cpu_flags = native.cpu_flags
# The GGML types the kernels read (the C++ table of formats, csrc/formats.h, says the same: `formats()`)
SUPPORTED_TYPES = {2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
BLOCK = {2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
# Q4_K, Q6_K, Q4_0 and Q5_0 with 16 channels interleaved (`repack_x16`): the kernels' own layouts, not GGML
# types (the file's type + 100)
Q4_0, Q5_0, Q4_K, Q6_K = 2, 6, 12, 14
Q4_0_X16, Q5_0_X16, Q4_K_X16, Q6_K_X16 = 102, 106, 112, 114
X16_TYPES = {Q4_K: Q4_K_X16, Q6_K: Q6_K_X16, Q4_0: Q4_0_X16, Q5_0: Q5_0_X16}

_lock = threading.Lock()
_ops: dict[str, object] = {}
_error: str | None = None


def best_isa() -> str:
    """The fastest build this CPU runs, or the one `SPECDEC_QGEMM_ISA` names."""
    forced = os.environ.get("SPECDEC_QGEMM_ISA")
    if forced:
        if forced not in _ISA_FLAGS:
            raise ValueError(f"SPECDEC_QGEMM_ISA={forced!r}; choose {', '.join(_ISA_FLAGS)}")
        return forced
    return _default_isa()


@functools.lru_cache(maxsize=None)
def _default_isa() -> str:
    for isa in _ISA_FLAGS:
        if not native.runs_isa(isa):
            continue
        if isa == "avx512amx" and not _tiles_usable():
            continue
        return isa
    raise AssertionError("the generic build runs anywhere")


def _tiles_usable() -> bool:
    """Whether the AMX build is there (installed, or built by a compiler that knows the tile instructions)
    and the OS lets this process use the tile registers."""
    try:
        return bool(ops("avx512amx").uses_tiles())
    except Exception as exc:  # not built: the AVX-512 build does the same work (and bits), slower
        logger.warning("the AMX build of the block kernels is not used (%s: %s)", type(exc).__name__, str(exc)[-300:])
        return False


def ops(isa: str | None = None):
    """The ops of one build (`torch.ops.specdec_qgemm_<isa>`): the library installed with specdec (in a
    developer's checkout whose C++ differs from it, built on first use)."""
    isa = isa or best_isa()
    if isa in _ops:
        return _ops[isa]
    with _lock:
        if isa not in _ops:
            if not native.runs_isa(isa):
                raise RuntimeError(f"this CPU cannot run the {isa} build of the qgemm kernels")
            lib_ops = native.load_ops(f"specdec_qgemm_{isa}")
            if isa.startswith("avx512"):
                lib_ops.set_pair_rows(tuning.pair_rows(isa, lib_ops))
            wide = wide_rows()
            if wide is not None:
                lib_ops.set_wide_rows(wide)
            _ops[isa] = lib_ops
    return _ops[isa]


def interleaved_types() -> frozenset[int]:
    """The GGML types whose matrices (of a multiple of 16 rows) are laid out 16 channels side by side at load
    (`repack_x16`), where the kernels on that layout keep the channels in the vector lanes and share each
    register's unpacking among the rows (the same bits): Q4_K, Q6_K, Q4_0 and Q5_0 on the AVX-512 VNNI build
    (not the AMX one, whose tiles read the file's layout); Q4_K and Q6_K on the AVX2 build (its Q5_0 is read
    as Q8_0 instead, `widens_q5_0`). `SPECDEC_QGEMM_X16=0|1` turns it off, or on for all four (on the
    portable build: a portable loop, slow)."""
    forced = _switch("SPECDEC_QGEMM_X16")
    if forced is not None:
        return frozenset(X16_TYPES) if forced else frozenset()
    return {"avx512vnni": frozenset(X16_TYPES), "avx2": frozenset({Q4_K, Q6_K})}.get(best_isa(), frozenset())


def wide_rows() -> int | None:
    """From how many rows in a block of 128 the 16-channel Q6_K layout unpacks each weight block once for all of
    them rather than once a group of 4 (the same bits): `SPECDEC_QGEMM_WIDE_ROWS`, 0 for never; None (unset)
    keeps the kernels' default, 16."""
    value = os.environ.get("SPECDEC_QGEMM_WIDE_ROWS")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"SPECDEC_QGEMM_WIDE_ROWS={value!r}; give a row count (0: never)")
    return int(value)


def widens_q5_0() -> bool:
    """Whether Q5_0 matrices are read as Q8_0 copies (`widen_q5_0`: 34 bytes a block instead of 22, the same
    bits): on the AVX2 build, whose Q5_0 product is bound by unpacking the fifth bits (the default draft's
    gate/up at ~4 GB/s against ~9 as Q8_0, on a 2-core Zen 1; docs/kernels.md). The 512-bit builds read
    Q5_0 16 channels side by side or in tiles instead. `SPECDEC_QGEMM_Q5_0_AS_Q8_0=0|1` turns it off or on."""
    forced = _switch("SPECDEC_QGEMM_Q5_0_AS_Q8_0")
    return best_isa() == "avx2" if forced is None else forced


def _switch(variable: str) -> bool | None:
    """An on/off environment variable: "1" True, "0" False, unset or empty None; anything else refused."""
    value = os.environ.get(variable)
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{variable}={value!r}; choose 0 or 1")
    return value == "1"


def widen_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks uint8 [N, K // 32 * 22] -> Q8_0 blocks [N, K // 32 * 34]: each block's fp16 scale and its
    32 weights (5-bit quant - 16) as int8, which a Q8_0 product multiplies exactly as the Q5_0 kernels do.
    Example: a block with scale 0.5, quant 3 (low nibble 3, fifth bit 0) -> weight 3 - 16 = -13."""
    return ops().widen_q50_q80(blocks.contiguous())


def repack_x16(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_K, Q6_K, Q4_0 or Q5_0 blocks uint8 [N, row_bytes] (N a multiple of 16) -> uint8 [N / 16, 16 x
    row_bytes] (Q4_K: K / 256 * 2368, the scales unpacked): each block of 16 channels interleaved (the
    quants of channel c in lane c of each 64-byte register), for `qmm` with type `X16_TYPES[qtype]`.
    Computes the same bits as the blocks themselves."""
    repack = {Q4_K: "repack_q4k_x16", Q6_K: "repack_q6k_x16", Q4_0: "repack_q40_x16", Q5_0: "repack_q50_x16"}
    if qtype not in repack:
        raise ValueError(f"no 16-channel layout for type {qtype}")
    return getattr(ops(), repack[qtype])(blocks.contiguous())


def unavailable_reason() -> str | None:
    """None when the kernels of this CPU's build are installed (or, in a developer's checkout, can be built)
    and load, else why not. Loads them on first call."""
    global _error
    if _error is None and best_isa() not in _ops:
        try:
            ops()
        except Exception as exc:  # a missing compiler or build tool
            _error = f"{type(exc).__name__}: {str(exc)[-500:]}"
    return _error


def qmm(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    types: list[int],
    bias: torch.Tensor | None = None,
    isa: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) @ concat(weights).T + bias -> [..., N] in `out_dtype` (default: x's).

    weights[i]: uint8 [N_i, row_bytes] blocks of GGML type types[i]; bias: fp32 [sum N_i] or None.
    """
    shape = x.shape
    y = ops(isa).qmm(x.reshape(-1, shape[-1]), weights, types, bias, out_dtype)
    return y.view(*shape[:-1], y.shape[-1])


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q4_0 blocks uint8 [N, K // 32 * 18], as ggml's reference quantizer does: each block of
    32 values has the scale d = m / -8 (m: its value of largest magnitude, with its sign) and the quants
    min(15, floor(v / d + 8.5)), value j in the low nibble of byte j and value 16 + j in its high nibble.
    K must be a multiple of 32. Example: a block whose largest magnitude is -2.0 -> d = 0.25, and 1.0 -> 12."""
    N, K = w.shape
    if K % 32:
        raise ValueError(f"Q4_0 needs rows of a multiple of 32 values, not {K}")
    blocks = w.float().reshape(N, K // 32, 32)
    at = blocks.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, as ggml's strict `<` keeps
    d = blocks.gather(-1, at).squeeze(-1) / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    # ggml truncates (int8) (x + 8.5) toward zero; the sum is >= 0 but for rounding, so floor and clamp below
    q = torch.floor(blocks * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
    out = torch.empty(N, K // 32, 18, dtype=torch.uint8)
    out[..., :2] = d.to(torch.float16).view(torch.uint8).reshape(N, K // 32, 2)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(N, K // 32 * 18)


def requantize_q4_0(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q8_0 or Q5_0 blocks uint8 [N, row_bytes] -> Q4_0 blocks [N, K // 32 * 18]: the bytes of
    `quantize_q4_0(dequantize_rows(blocks, qtype, K))`, computed block by block in C++."""
    return ops().requantize_q4_0(blocks.contiguous(), qtype)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q8_0 blocks uint8 [N, K // 32 * 34] (fp16 scale amax / 127, int8 quants), as ggml's
    reference quantizer does. K must be a multiple of 32. Example: a row of 32 values 0..31 -> scale
    31 / 127, quants round(v * 127 / 31)."""
    N, K = w.shape
    if K % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 values, not {K}")
    blocks = w.float().reshape(N, K // 32, 32)
    amax = blocks.abs().amax(-1)
    d = amax / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    out = torch.empty(N, K // 32, 34, dtype=torch.uint8)
    out[..., :2] = d.to(torch.float16).view(torch.uint8).reshape(N, K // 32, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(N, K // 32 * 34)
