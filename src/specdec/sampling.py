"""Logits -> processed probabilities (temperature, top-k, top-p), and seeded draws.

The same processing is applied to draft and target logits before the acceptance test, so speculative
sampling follows exactly the distribution that plain sampling with these settings would draw from.
Greedy (temperature 0) never comes here: it is an exact argmax.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] (fp32) from logits [N, V] after temperature, top-k, then top-p.

    Example: logits [2, 1, 0], temperature 1, top_k 2 -> softmax over [2, 1] = [0.73, 0.27, 0].
    top_p keeps the smallest set of most likely tokens whose mass reaches top_p (the token that
    crosses the threshold is kept).
    """
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] (need not be normalized), drawn with `generator`."""
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
