"""Choosing the weight format (`resolve_quantization`), and the earlier weight-only int8 / int4 layers.

The default on CPU is the GGUF's own blocks on specdec's integer kernels (`specdec.models.qlinear`,
`specdec.kernels.qgemm`). The int8 / int4 formats below remain for comparison: int8 layers run specdec's
own AVX2 kernel (`specdec.kernels`), which converts each weight chunk once for every row and gives every
row the same bits whatever the number of rows. A draft's numerics change only how often it agrees with
the target, never the output.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.config import QUANTIZATIONS
from specdec.kernels import available as int8_kernel_available, int8_linear, qgemm


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, with q int8 per output channel (symmetric)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = int8_linear(x.reshape(-1, shape[-1]), self.qweight, self.scale)
        y = y.view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Asymmetric int4 per group of `group_size` input channels, packed for torch's CPU int4 kernel."""

    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        N, K = w.shape
        if K % group_size:
            raise ValueError(f"in_features {K} is not a multiple of the int4 group size {group_size}")
        groups = w.view(N, K // group_size, group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)  # [N, G]
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
        zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.group_size = group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
        self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), self.packed, self.group_size, self.scales_and_zeros
        )
        y = y.view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


BLOCK_FORMATS = ("gguf", "q8_0", "q4_0")  # run by specdec.kernels.qgemm (see models.qlinear)


def resolve_quantization(method: str, device: torch.device) -> str:
    """`auto`: on CPU, the GGUF's own blocks (a Hugging Face folder: Q8_0 blocks), run by specdec's
    integer kernels; on CUDA, none (bf16). `gguf`/`q8_0`/`q4_0`: block kernels (`q8_0` and `q4_0`
    requantize every matrix to that type); `int8`/`int4`: earlier weight-only formats (float activations
    times int weights); `none`: float weights."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose {', '.join(QUANTIZATIONS)}")
    if method == "auto":
        if device.type != "cpu":
            return "none"
        reason = qgemm.unavailable_reason()
        if reason is not None:
            warnings.warn(f"specdec's block kernels cannot be built here ({reason}); running float weights",
                          RuntimeWarning, stacklevel=2)
            return "none"
        return "gguf"
    if method != "none" and device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on CPU kernels; use 'none' on {device.type}")
    return method


def quantize_linears(model: nn.Module, method: str) -> None:
    """Replace every nn.Linear of `model` in place (weights become int8/int4; activations stay bf16)."""
    if method == "none":
        return
    if model.dtype != torch.bfloat16:
        raise ValueError(f"{method} weights run with bfloat16 activations; the model is {model.dtype}")
    if method == "int8":
        int8_kernel_available()  # compile the kernel now (once per machine), not at the first forward
    make = {"int8": Int8Linear, "int4": Int4Linear}[method]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
