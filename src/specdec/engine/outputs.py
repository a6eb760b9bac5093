"""What the engine hands back: per-step deltas for streaming, and finished results."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.metrics import SpecMetrics


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token's own, its rank (1 = most likely) and the top alternatives
    as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One request's progress after an engine step (a delta) or at the end (the whole).

    `new_token_ids`/`new_text` are what this step added; `token_ids`/`text` are everything so far.
    `finish_reason` is None while running, then "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or the context is full) or "abort" (cancelled, or failed: then `error` says why).
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or EOS id that ended the request
    error: str | None = None  # the engine failed this request (the others went on): the exception, in words
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    # with SamplingParams.logprobs: one entry per token, of this step (new_) and of all so far
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # LLM.generate with n > 1: the request's completions, this one first (index 0)
    index: int = 0
    outputs: list["RequestOutput"] = field(default_factory=list)
