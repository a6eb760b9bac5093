"""A request as the engine runs it: its tokens, its text, its cache row, its grammar, its metrics; and what it
reports after each step (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.config import SamplingParams
from specdec.engine.metrics import SpecMetrics
from specdec.engine.output_text import OutputText
from specdec.engine.outputs import RequestOutput, TokenLogprob
from specdec.engine.structured import Grammar, GrammarMatcher
from specdec.engine.verification import Judged, token_logprobs
from specdec.models.tokenizer import Tokenizer
from specdec.speculative.costs import AcceptanceEstimate
from specdec.speculative.proposers import Draft


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: OutputText  # its text, and where it stops
    tokens: list[int] = field(default_factory=list)  # prompt + output
    row: int = -1
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    start_time: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs
    matcher: GrammarMatcher | None = None  # with params.response_format: the grammar's state
    error: str | None = None  # why the engine failed it (finish_reason "abort")
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes
    draft_state: Any = None  # the proposer's, for this sequence

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's log-probabilities are still to be computed (asked for, and not all in)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    def record_logprobs(self, logprobs: torch.Tensor, tokens: list[int]) -> None:
        """Append the emitted `tokens`' entries; logprobs [len(tokens), V] are their rows' log-probabilities."""
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        self.cumulative_logprob += float(chosen.sum())
        if self.logprobs is not None:
            self.logprobs.extend(token_logprobs(logprobs, tokens, self.params.logprobs))

    def emit(self, draft: Draft, judged: Judged, draft_seconds: float, target_seconds: float) -> RequestOutput:
        """Append the verdict's tokens on `draft` (stop rules applied), record them and the step's share of
        drafting and target time, and report its output."""
        new_ids = self.output.append(judged.verdict.output_tokens(draft.tokens))
        self.tokens += new_ids
        if self.matcher is not None:
            self.matcher.advance(new_ids)
        if judged.logprobs is not None:
            self.record_logprobs(judged.logprobs[judged.slots[:len(new_ids)]], new_ids)
        self.metrics.record_step(draft.depth, judged.verdict.num_accepted, len(new_ids), draft.source)
        self.metrics.draft_time += draft_seconds
        self.metrics.target_time += target_seconds
        return self.report(new_ids)

    def report(self, new_ids: list[int]) -> RequestOutput:
        """What it reports after a step that emitted `new_ids`."""
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            new_token_ids=new_ids,
            token_ids=self.output_ids,
            text=self.output.text,
            finished=self.finish_reason is not None,
            finish_reason=self.finish_reason,
            stop_reason=self.output.stop_reason,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
            new_text=self.output.new_text(),
        )
        if self.logprobs is not None:
            out.logprobs = self.logprobs
            out.new_logprobs = self.logprobs[len(self.logprobs) - len(new_ids):]
        if self.logprobs is not None or (self.params.best_of or 1) > self.params.n:
            out.cumulative_logprob = self.cumulative_logprob
        return out


def request_grammar(prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                    max_model_len: int) -> Grammar | None:
    """Check a request (a clear ValueError for a bad one) and return its grammar (None: no response_format)."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    bad = [t for t in (*prompt_ids, *params.stop_token_ids, *(t for t, _ in params.logit_bias))
           if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of range for this model's vocabulary of {vocab_size} tokens")
    grammar = None if params.response_format is None else \
        Grammar.from_response_format(params.response_format, tokenizer, vocab_size)
    if n + params.max_tokens > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but {n + params.max_tokens} "
            f"were requested ({n} in the prompt, {params.max_tokens} to generate)"
        )
    return grammar
