"""Choosing K, the number of tokens to draft this step: fixed, or adaptive from measured costs.

The adaptive controller follows Leviathan et al.: with per-token acceptance rate a, a step that drafts K
tokens emits E(K) = (1 - a^(K+1)) / (1 - a) tokens on average and costs K * t_draft + t_verify(K + 1).
It picks the K in [0, K_max] with the most tokens per second, where a is estimated per sequence from its
recent verdicts and the times are measured live (per batch size and rows verified). K = 0 is plain
decoding; while K = 0 wins, the controller probes with K = 1 every `probe_interval` steps, so a draft
that starts agreeing again is noticed. Before anything is measured it probes too (K = 1): a cheap step
that measures a draft forward and a 2-row verification (longer drafts are then tried from those costs).

Example: a = 0.8, t_draft / t_verify = 0.1 -> E(5) = 3.69 tokens for 1.5 pass-times: 2.46 tokens per
pass-time, better than K = 0 (1.0) or K = 8 (4.33 / 1.8 = 2.40).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted drafted tokens and of rejections, for one sequence.

    Under a geometric model (each drafted token accepted with probability a, until the first rejection)
    the estimate a = accepted / (accepted + rejections) is the maximum-likelihood one. Starts from a
    weak prior of 0.6 (or from what earlier sequences measured: `with_prior`).
    """

    accepted: float = 1.8
    rejections: float = 1.2
    steps_off: int = 0  # steps since speculation was turned off for this sequence
    probe_every: int = 0  # steps between probes while off (0: the controller's base interval)
    probing: bool = False  # this step's draft is a probe (speculation is off otherwise)

    @classmethod
    def with_prior(cls, rate: float, weight: float = 3.0) -> "AcceptanceEstimate":
        return cls(accepted=weight * rate, rejections=weight * (1.0 - rate))

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def update(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        if num_drafted == 0:
            return
        self.accepted = self.accepted * decay + num_accepted
        self.rejections = self.rejections * decay + (1 if num_accepted < num_drafted else 0)


def expected_tokens(a: float, k: int) -> float:
    """E(K) = 1 + a + ... + a^K, the mean tokens one pass emits (bonus/recovered included)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class CostModel:
    """Running means of the time of one draft forward (by batch size) and of one target pass (by rows)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.draft: dict[int, float] = {}  # batch size -> seconds per draft forward
        self.verify: dict[int, float] = {}  # rows in the target pass -> seconds

    def _update(self, table: dict[int, float], key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        self._update(self.draft, batch_size, seconds_per_forward)

    def record_verify(self, rows: int, seconds: float) -> None:
        self._update(self.verify, rows, seconds)

    @staticmethod
    def _nearest(table: dict[int, float], key: int) -> float | None:
        if not table:
            return None
        if key in table:
            return table[key]
        return table[min(table, key=lambda k: abs(k - key))]

    def draft_time(self, batch_size: int) -> float | None:
        return self._nearest(self.draft, batch_size)

    def verify_time(self, rows: int) -> float | None:
        return self._nearest(self.verify, rows)


class FixedK:
    """Always draft K tokens (speculation off when K = 0)."""

    adaptive = False

    def __init__(self, k: int) -> None:
        self.k_max = k

    def choose(self, estimates: list[AcceptanceEstimate], costs: CostModel) -> list[int]:
        return [self.k_max] * len(estimates)


class AdaptiveK:
    """Per sequence, the K that maximises expected tokens per second at the current batch size."""

    adaptive = True

    def __init__(self, k_max: int, probe_interval: int = 16, max_probe_interval: int = 256,
                 decay: float = 0.9) -> None:
        self.k_max = k_max
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.decay = decay

    def best_k(self, a: float, batch_size: int, costs: CostModel) -> int:
        t_draft = costs.draft_time(batch_size)
        t_one = costs.verify_time(batch_size)
        if t_draft is None or t_one is None:
            return -1  # nothing measured yet: see `choose`
        best_k, best_rate = 0, 1.0 / t_one
        for k in range(1, self.k_max + 1):
            t_verify = costs.verify_time(batch_size * (k + 1))
            rate = expected_tokens(a, k) / (k * t_draft + t_verify)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def choose(self, estimates: list[AcceptanceEstimate], costs: CostModel) -> list[int]:
        ks = []
        for est in estimates:
            k = self.best_k(est.rate, len(estimates), costs)
            est.probing = False
            if k < 0:  # nothing measured yet: one cheap probe (K = 1) measures a draft step and a 2-row pass
                k, est.probing = 1, True
            elif k == 0:
                est.steps_off += 1
                if est.steps_off >= (est.probe_every or self.probe_interval):  # probe: agreeing again?
                    est.steps_off = 0
                    est.probe_every = min(2 * (est.probe_every or self.probe_interval), self.max_probe_interval)
                    k, est.probing = 1, True
            else:
                est.steps_off, est.probe_every = 0, 0
            ks.append(k)
        return ks
