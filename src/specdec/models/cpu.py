"""What the CPU offers bf16 models, and the one torch setting that keeps their matmuls row-invariant."""

from __future__ import annotations

import logging

import torch

from specdec.kernels.native import cpu_flags

logger = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    """The CPU flags (Linux) list native bf16 arithmetic: AVX-512 BF16 or AMX."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def onednn_takes_bf16() -> bool:
    """torch would send bf16 matmuls to oneDNN on this CPU (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def use_one_bf16_matmul_kernel() -> bool:
    """Send every CPU bf16 matmul of this process to one family of kernels; True if that took a change.

    On a CPU with AVX-512 but no native bf16, torch computes a one-row bf16 matmul (and any of at most
    16x16x16 multiply-adds) with its own kernel and a larger one with oneDNN's, which emulates bf16 and rounds
    differently: a token decoded alone would then get other bits than the same token verified among drafts.
    Turning oneDNN off (`torch.backends.mkldnn.enabled`, process-wide: torch has no narrower switch) leaves
    torch's own kernels for every row count, as on AVX2 CPUs. Nothing changes where the CPU has native bf16
    (oneDNN takes every row count) or lacks AVX-512 (oneDNN's bf16 is never used); fp32 matmuls never go
    through oneDNN at torch's default precision."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if not onednn_takes_bf16() or cpu_has_native_bf16():
        return False
    torch.backends.mkldnn.enabled = False
    logger.info("CPU without native bf16: oneDNN turned off so that bf16 matmuls are row-invariant")
    return True
