"""A deliberately bad draft: a real draft model whose logits are permuted, so it rarely agrees.

Used by tests and benchmarks of adaptive speculation (the acceptance-degradation scenario); nothing at
run time drafts with it (`specdec bench` offers no degraded method).
"""

from __future__ import annotations

import torch
from torch import nn


class PermutedLogitsModel(nn.Module):
    """Wraps a model; its logits over the vocabulary come out in a fixed random order."""

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("perm", torch.randperm(model.config.vocab_size, generator=gen).to(model.device))

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def new_cache(self, batch_size: int, capacity: int, num_pages: int | None = None):
        return self.inner.new_cache(batch_size, capacity, num_pages)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.inner(*args, **kwargs)[..., self.perm]
