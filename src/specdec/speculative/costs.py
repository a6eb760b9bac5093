"""What a draft is worth and what a pass costs: the numbers the controller (`controller`) chooses K from.

`AcceptanceEstimate`: a sequence's acceptance rate (decayed counts of accepted drafted tokens and
rejections), `expected_tokens` the tokens a pass of K drafted tokens emits at that rate (Leviathan et al.),
`CostModel` the measured time of a draft forward by batch size and of a target pass by rows and context
depth (`LineFit`: a line fitted to every pass), and `default_clock` the clock they are measured with.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass

import torch


def default_clock() -> float:
    """perf_counter, after the work queued on a GPU (it belongs to what was timed)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted drafted tokens and of rejections, for one sequence.

    Under a geometric model (each drafted token accepted with probability a, until the first rejection)
    the estimate a = accepted / (accepted + rejections) is the maximum-likelihood one. Starts from a
    weak prior of 0.6 (or from what earlier sequences measured: `with_prior`).
    """

    accepted: float = 1.8
    rejections: float = 1.2
    read_prompt: bool = False  # a draft model read this sequence's prompt (it drafts with its whole context)
    # (`ByKind`) this sequence's lean: its drafted tokens accepted, and what the rates of their kinds expected
    kind_accepted: float = 0.0
    kind_expected: float = 0.0

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

    @property
    def lean(self) -> float:
        """How much better (> 1) or worse this sequence's drafted tokens fare than their kinds do on average,
        from a prior of 1 worth 2 tokens."""
        return (self.kind_accepted + 2.0) / (self.kind_expected + 2.0)


def expected_tokens(a: float, k: int) -> float:
    """E(K) = 1 + a + ... + a^K, the mean tokens one pass emits (bonus/recovered included)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class LineFit:
    """t(rows) = a + b * rows, fitted by least squares to decayed measurements (each new one weighs 1, older
    ones `forget` times less per measurement): every pass informs every width, where a mean per width
    (`CostModel`) leaves a rarely seen width to a few noisy passes. `time` is None until two widths are
    measured. Example: 1 row in 1.0 s, 3 rows in 1.2 s -> time(2) = 1.1, time(13) = 2.2."""

    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        f = self.forget
        self.n, self.sx, self.sy = self.n * f + 1, self.sx * f + rows, self.sy * f + seconds
        self.sxx, self.sxy = self.sxx * f + rows * rows, self.sxy * f + rows * seconds

    def time(self, rows: int) -> float | None:
        if self.n == 0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < 0.05:  # (about one width only)
            return None
        slope = max(0.0, (self.sxy / self.n - mx * my) / var)  # more rows never cost less
        return max(my + slope * (rows - mx), 1e-9)


# context tokens per sequence where the cost of a target pass is measured apart (attention grows with the
# context: at 8k tokens a pass of several rows costs more, relative to one row, than at 500)
DEPTH_BANDS = (1024, 2048, 4096, 8192, 16384)


class CostModel:
    """Running means of the time of one draft forward (by batch size) and of one target pass (by rows), the
    latter at the context depth of the step (`at`).

    Unmeasured sizes are estimated from measured ones: linearly between the two nearest, and outside the
    measured range along the line through the two nearest, kept between the nearest's cost and that
    cost scaled in proportion to the size (more rows never cost less, nor more than proportionally
    more). With a single measurement, the cost grows by `prior_slope` of it per size of it (halfway
    between free and proportional). Example: verify {1: 1.0, 2: 1.2} -> verify_time(6) = 2.0;
    verify {2: 1.0} alone -> verify_time(6) = 1.0 * (1 + 0.5 * 4 / 2) = 2.0. No size is estimated
    above a larger measured size: verify {1: 3.0, 2: 1.2} -> verify_time(1) = 1.2.

    Target passes are kept by depth band (`DEPTH_BANDS`: the mean context tokens of the batch's sequences),
    the controller naming each step's (`at`) before it asks costs of it or records them. A band with passes
    of one width only (speculation off there, or new) takes its shape from the nearest band measured at two
    widths or more, scaled to its own: measured {1: 1.0, 4: 1.2} below 1k tokens and {1: 2.0} at 8k ->
    verify_time(4) at 8k = 2.0 * 1.2 = 2.4; a band with nothing measured borrows the nearest band's costs.
    """

    def __init__(self, smoothing: float = 0.2, prior_slope: float = 0.5) -> None:
        self.smoothing = smoothing
        self.prior_slope = prior_slope
        self.draft: dict[int, float] = {}  # batch size -> seconds per draft forward
        self.verify: dict[int, float] = {}  # rows in the target pass -> seconds
        self.prefill: dict[str, float] = {}  # "target" / "draft" -> seconds per prompt token
        self.verify_fit = LineFit()  # every target pass, for `pass_time`
        self.ride_fit = LineFit()  # passes a joining prompt's rows rode in, by all their rows (`record_pass`)
        self.band = 0  # the depth band `verify`, `verify_fit` and `ride_fit` hold (`at`)
        self._bands: dict[int, tuple[dict[int, float], LineFit, LineFit]] = {}  # the other bands' tables

    def at(self, context: int) -> None:
        """The mean context tokens per sequence of the step about to be costed and recorded."""
        band = bisect_right(DEPTH_BANDS, context)
        if band != self.band:
            self._bands[self.band] = (self.verify, self.verify_fit, self.ride_fit)
            self.verify, self.verify_fit, self.ride_fit = self._bands.pop(band, None) or ({}, LineFit(), LineFit())
            self.band = band

    def _shape(self) -> tuple[dict[int, float], LineFit, LineFit] | None:
        """The tables of the band nearest this one that has passes of two widths or more (None: no such band)."""
        shaped = [b for b, (table, _, _) in self._bands.items() if len(table) >= 2]
        if not shaped:
            return None
        return self._bands[min(shaped, key=lambda b: (abs(b - self.band), b))]

    def _update(self, table: dict, key: int | str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        self._update(self.draft, batch_size, seconds_per_forward)

    def record_verify(self, rows: int, seconds: float) -> None:
        self._update(self.verify, rows, seconds)
        self.verify_fit.add(rows, seconds)

    def record_pass(self, rows: int, seconds: float) -> None:
        """A target pass of `rows` rows in all, a joining prompt's among them (not a measure of the decoding
        rows alone: `verify` keeps none of it). While the passes of decoding alone have no line yet
        (`pass_time`), these give one: a batch whose prompts join one after another may decode for dozens of
        steps with a prompt's rows in every pass, and its drafts must be cut by what rows cost meanwhile
        (seen: a single 24-row pass, scaled by `prior_slope`, put 12 rows at 1.2x 6 rows on a CPU where they
        took 1.86x, and Medusa drafts accepted 35% of the time widened every pass of that phase)."""
        self.ride_fit.add(rows, seconds)

    def _estimate(self, table: dict[int, float], key: int) -> float | None:
        """The cost at size `key`, never above what a larger size was measured to cost: a stale slow
        measurement of a small size (one noisy pass, never repeated while the controller keeps away
        from that size) must not make the larger sizes look cheaper than it."""
        if not table:
            return None
        ceiling = min((v for k, v in table.items() if k > key), default=float("inf"))
        return min(self._interpolate(table, key), ceiling)

    def _interpolate(self, table: dict[int, float], key: int) -> float:
        if key in table:
            return table[key]
        keys = sorted(table)
        below = [k for k in keys if k < key]
        above = [k for k in keys if k > key]
        if below and above:  # interpolate
            k0, k1 = below[-1], above[0]
            return table[k0] + (table[k1] - table[k0]) * (key - k0) / (k1 - k0)
        k1 = above[0] if above else below[-1]  # the nearest measured size
        if len(keys) == 1:
            guess = table[k1] * (1 + self.prior_slope * (key - k1) / k1)
        else:
            k0 = above[1] if above else below[-2]  # the next nearest
            guess = table[k1] + (table[k1] - table[k0]) / (k1 - k0) * (key - k1)
        # more rows never cost less, nor more than proportionally more
        low, high = sorted((table[k1], table[k1] * key / k1))
        return min(max(guess, low), high)

    def record_prefill(self, model: str, tokens: int, seconds: float) -> None:
        """Time taken by `model` ("target" or "draft") to read `tokens` prompt tokens."""
        if tokens > 0:
            self._update(self.prefill, model, seconds / tokens)

    def draft_prefill_time(self, tokens: int) -> float | None:
        """Seconds the draft takes to read `tokens` prompt tokens: measured, else the target's time scaled by
        the draft/target cost of one forward; None when neither is known."""
        per_token = self.prefill.get("draft")
        if per_token is None and "target" in self.prefill and self.draft and self.verify_time(1) is not None:
            per_token = self.prefill["target"] * self.draft_time(1) / self.verify_time(1)
        return None if per_token is None else per_token * tokens

    def draft_time(self, batch_size: int) -> float | None:
        return self._estimate(self.draft, batch_size)

    def verify_time(self, rows: int) -> float | None:
        shape = self._shape() if len(self.verify) < 2 else None
        if shape is None:
            return self._estimate(self.verify, rows)
        if not self.verify:
            return self._estimate(shape[0], rows)
        (width, seconds), = self.verify.items()
        return seconds * self._estimate(shape[0], rows) / self._estimate(shape[0], width)

    def pass_time(self, rows: int) -> float | None:
        """A target pass of `rows` rows on the line fitted to every pass of this depth (`LineFit`), else on
        the line of the passes that a prompt rode in (`record_pass`), else `verify_time`."""
        fitted = self.verify_fit.time(rows)
        if fitted is None:
            fitted = self.ride_fit.time(rows)
        return self.verify_time(rows) if fitted is None else fitted
