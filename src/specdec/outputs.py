"""What the engine hands back: per-step deltas for streaming, and finished results."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.metrics import SpecMetrics


@dataclass
class RequestOutput:
    """One request's progress after an engine step (a delta) or at the end (the whole).

    `new_token_ids`/`new_text` are what this step added; `token_ids`/`text` are everything so far.
    `finish_reason` is None while running, then "stop" (EOS or stop string), "length" (max_tokens or
    the context is full) or "abort" (cancelled).
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
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
