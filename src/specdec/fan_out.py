"""n and best_of, above the engine: one request runs `best_of` (default `n`) engine sequences per prompt, and
returns the n best of them. `LLM` and the server both plan their engine requests with `sub_requests` and
collect their choices with `pick_best`; the engine itself knows one sequence per request.

    plan = sub_requests([[1, 2, 3]], SamplingParams(n=2, seed=7), lambda i, j: f"req-{i}-{j}")
    # [[SubRequest(0, "req-0-0", [1, 2, 3], seed 7), SubRequest(0, "req-0-1", [1, 2, 3], seed 8)]]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from specdec.config import SamplingParams
from specdec.engine.outputs import RequestOutput


@dataclass(frozen=True)
class SubRequest:
    """One engine request: sequence `j` of prompt `prompt_index`, with its own params (seed)."""

    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The params of each sequence a request runs: `best_of` (default `n`) of them, seeded seed, seed + 1, ...
    (as vLLM seeds parallel samples) so that seeded requests stay reproducible and their samples differ.
    Seeds wrap past 2**64 - 1, the largest a torch generator takes: 2**64 - 1, 0, 1, ..."""
    count = params.best_of or params.n
    if params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=seed if seed < 2**64 else seed - 2**64)
            for seed in range(params.seed, params.seed + count)]


def sub_requests(prompt_ids: list[list[int]], params: SamplingParams,
                 request_id: Callable[[int, int], str]) -> list[list[SubRequest]]:
    """For each prompt, its engine requests (`fan_out`); `request_id(i, j)` names sequence j of prompt i."""
    return [[SubRequest(i, request_id(i, j), ids, seq_params) for j, seq_params in enumerate(fan_out(params))]
            for i, ids in enumerate(prompt_ids)]


def pick_best(outputs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The `n` completions a request returns from its finished sequences (in `fan_out`'s order): all of them,
    or with best_of > n the n with the highest cumulative log-probability; numbered 0..n-1."""
    if len(outputs) > params.n:
        outputs = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[: params.n]
    for i, out in enumerate(outputs):
        out.index = i
    return outputs
