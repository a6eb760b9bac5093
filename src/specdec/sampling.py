"""Logits -> processed logits (bias, min_tokens, penalties) -> probabilities (temperature, min-p, top-k,
top-p), seeded draws, and log-probabilities.

Every position of a verification pass is processed as plain decoding would process it: the history a
penalty counts is the sequence's output plus the drafted tokens before that position (`process_rows`).
So greedy speculation emits exactly plain greedy's tokens (the argmax of the processed logits), and
speculative sampling draws from exactly plain sampling's distribution. A draft may use any distribution:
the acceptance test corrects it (proposers process theirs with `process_logits` alone).
"""

from __future__ import annotations

import torch

from specdec.config import SamplingParams


def process_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    drafted: list[list[int]],
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """Logits [T, V] (fp32) of T positions after logit_bias, min_tokens and the penalties, in vLLM's order.

    Position t follows `output_ids + drafted[t]` (the drafted tokens on its path); `stop_ids` are the
    tokens min_tokens holds back (EOS unless ignored, and stop_token_ids).
    Example: output [4, 4], drafted [[], [7]], frequency_penalty 0.5 -> token 4 loses 1.0 at both
    positions, token 7 loses 0.5 at position 1 only.
    """
    logits = logits.float().clone()
    T, V = logits.shape
    for token, bias in params.logit_bias:
        if token < V:
            logits[:, token] += bias
    if params.min_tokens:
        held = torch.tensor(sorted(t for t in stop_ids if t < V), dtype=torch.long)
        for t in range(T):
            if len(output_ids) + len(drafted[t]) < params.min_tokens and len(held):
                logits[t, held] = float("-inf")
    if params.has_penalties:
        counts = torch.zeros(T, V)
        if output_ids:
            counts += torch.bincount(torch.tensor(output_ids), minlength=V)[:V]
        for t, path in enumerate(drafted):
            if path:
                counts[t].index_add_(0, torch.tensor(path), torch.ones(len(path)))
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt_ids:
                seen[:, torch.tensor(prompt_ids)] = True
            penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] (fp32) from logits [N, V] after temperature, min-p, top-k, then top-p.

    Example: logits [2, 1, 0], temperature 1, top_k 2 -> softmax over [2, 1] = [0.73, 0.27, 0].
    min_p 0.2 on probabilities [0.6, 0.3, 0.1] drops the last (0.1 < 0.2 * 0.6). top_p keeps the
    smallest set of most likely tokens whose mass reaches top_p (the token that crosses the threshold
    is kept).
    """
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        low = probs < params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(low, float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (a top_p of 1e-320 is 0 in float32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def logprob_rows(logits: torch.Tensor, params: SamplingParams, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities [N, V] of the distribution tokens are picked from: log_softmax of the processed
    logits when greedy, the log of `probs` (those of `process_logits`) when sampling."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(probs if probs is not None else process_logits(logits, params))


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
