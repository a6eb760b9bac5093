"""Speculative-decoding counters, per request and cumulative.

Terms, as in vLLM: each target pass emits `accepted + recovered + bonus` tokens. A *draft* is one
proposal of >= 1 tokens; *draft tokens* counts proposed tokens; *accepted tokens* counts the proposed
tokens the target kept; `accepted_per_position[i]` counts drafts whose token at position i was accepted.

    acceptance_rate        = accepted_tokens / draft_tokens
    mean_acceptance_length = 1 + accepted_tokens / drafts     (vLLM's: tokens per pass that drafted, the
                                                               bonus or recovered token included)
    tokens_per_pass        = emitted_tokens / target_passes   (every pass, those without a draft too)

Example: K=3, drafts [a b c] and the target accepts a, b and rejects c, emitting its own c'. One pass,
3 drafted, 2 accepted, emitted 3 (a b c'), accepted_per_position = [1, 1, 0].

Where several drafters take turns (auto speculation), `drafters` splits the draft counters by who drafted:
{"suffix": [drafts, draft tokens, accepted tokens], "medusa": [...]}.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DrafterCounts:
    """One drafter's share of a request's drafts (auto speculation's drafters take turns): passes it drafted
    for, tokens it drafted, tokens of them accepted. Unpacks in that order."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def __iter__(self):
        return iter((self.drafts, self.draft_tokens, self.accepted))

    def copy(self) -> "DrafterCounts":
        return DrafterCounts(self.drafts, self.draft_tokens, self.accepted)


@dataclass
class SpecMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_passes: int = 0  # verification/decoding passes of the target (prefill excluded)
    emitted_tokens: int = 0  # tokens produced by those passes
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    disk_cached_tokens: int = 0  # of those, the tokens whose blocks were read back from the disk tier
    preemptions: int = 0  # times it stepped out of the batch for want of K/V pages (and recomputed its tokens)
    prefill_time: float = 0.0  # seconds
    restore_time: float = 0.0  # of the prompt's cached prefix restored (its blocks read from disk included)
    first_token_time: float = 0.0  # from its arrival to its first output token (0: none yet)
    draft_time: float = 0.0
    target_time: float = 0.0
    total_time: float = 0.0
    drafters: dict[str, DrafterCounts] = field(default_factory=dict)  # where several drafters take turns

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, drafter: str | None = None) -> None:
        """Count one target pass that verified `num_drafted` tokens (drafted by `drafter`, where several take
        turns), kept `num_accepted` of them and emitted `num_emitted` (accepted + recovered/bonus, after stop
        rules)."""
        self.target_passes += 1
        self.emitted_tokens += num_emitted
        if num_drafted == 0:
            return
        if drafter is not None:
            counts = self.drafters.setdefault(drafter, DrafterCounts())
            counts.drafts += 1
            counts.draft_tokens += num_drafted
            counts.accepted += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecMetrics") -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_passes", "emitted_tokens",
                     "prompt_tokens", "cached_tokens", "disk_cached_tokens", "preemptions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("prefill_time", "restore_time", "draft_time", "target_time", "total_time"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.extend([0] * (len(other.accepted_per_position) - len(self.accepted_per_position)))
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n
        for name, counts in other.drafters.items():
            mine = self.drafters.setdefault(name, DrafterCounts())
            mine.drafts += counts.drafts
            mine.draft_tokens += counts.draft_tokens
            mine.accepted += counts.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        decode = self.total_time - self.prefill_time
        return self.emitted_tokens / decode if decode > 0 else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "target_passes": self.target_passes,
            "emitted_tokens": self.emitted_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "disk_cached_tokens": self.disk_cached_tokens,
            "preemptions": self.preemptions,
            "prefill_time_s": round(self.prefill_time, 4),
            "restore_time_s": round(self.restore_time, 4),
            "first_token_time_s": round(self.first_token_time, 4),
            "draft_time_s": round(self.draft_time, 4),
            "target_time_s": round(self.target_time, 4),
            "total_time_s": round(self.total_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            **({"drafters": {name: {"num_drafts": c.drafts, "num_draft_tokens": c.draft_tokens,
                                    "num_accepted_tokens": c.accepted}
                             for name, c in sorted(self.drafters.items())}} if self.drafters else {}),
        }


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens a drafting pass emits on average: 1 + accepted / drafts (0 without drafts). The one definition,
    for the engine's counters and the server's."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0
