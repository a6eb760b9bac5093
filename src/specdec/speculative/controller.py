"""Choosing K, the number of tokens to draft this step: fixed, or adaptive from measured costs.

The adaptive controller follows Leviathan et al.: with per-token acceptance rate a, a step that drafts K
tokens emits E(K) = (1 - a^(K+1)) / (1 - a) tokens on average and costs K * t_draft + t_verify(K + 1).
K = 0 is plain decoding.

K is chosen for the whole batch, not per sequence: a verification pass pads every row to the widest
draft and a draft model runs all rows for the longest draft, so a sequence drafting fewer tokens saves
nothing. With B sequences of acceptance rates a_1..a_B, the controller picks the K in [0, K_max] with
the most expected tokens per second, sum_i E(a_i, K) / (K * t_draft(B) + t_verify(B * (K + 1))), where
each a_i is estimated from sequence i's recent verdicts and the times are measured live, by batch size
and rows verified, and interpolated between what was measured (`CostModel`).

Switching speculation on costs a draft model a catch-up on the tokens it missed, which the formula does
not count, and measured costs are noisy: so from K = 0 the controller turns speculation on only for a
gain of `switch_margin` (10%) over plain decoding; once on, any gain keeps it on.

While K = 0 wins, the controller probes (K = 1) every `probe_interval` steps, the interval doubling up
to `max_probe_interval` while probes keep losing, so that a draft that starts agreeing again is
noticed. The interval is reset only once speculation has stayed on for `probe_interval` steps: a probe
that turns it on for a few steps, until the estimate drops again, counts as a losing one.
A probe is made only where it can pay (`probe_pays`). Not where even acceptance `probe_rate` would not
switch speculation on at this batch size (a gain under `switch_margin`: a large batch, where
verification is no longer free, or a draft that costs too much next to the target): there is nothing
to find out. And not where its cost (a draft step, a wider pass, a draft model's restart on a window of
`restart_tokens` per row) exceeds what speculation at acceptance `probe_rate` would save over the
batch's remaining output: near the end of short requests.
Before anything is measured it probes too: a cheap step that measures a draft forward and a 2-row
verification (longer drafts are then tried from those costs).

A draft model reads a joining prompt only where that pays (`prompt_pays`): the batch will speculate, and
the time speculation saves over the sequence's output exceeds the time the draft takes to read the
prompt. Example: the draft reads 150 prompt tokens in about 2 s; speculating saves 3 ms a token; for 48
output tokens it saves 0.14 s: the prompt is not read (and speculation, if it comes, restarts the
draft on a short window).

Example: a = 0.8, t_draft / t_verify = 0.1 -> E(5) = 3.69 tokens for 1.5 pass-times: 2.46 tokens per
pass-time, better than K = 0 (1.0) or K = 8 (4.33 / 1.8 = 2.40).

A proposer whose drafts cost nothing and label each token with a kind of guess (`Proposer.guess_kinds`:
suffix decoding, whose trie knows how sure it is of each token) gets `ByKind` instead: one rate per kind of
token, not per sequence, and no K to choose: it drafts what it can, and each draft is cut where its tokens
stop paying for the rows they add to the pass. A geometric rate per sequence would not do there: in one
answer a run the trie has seen 16 tokens of context for is accepted ~97% of the time, a guess after one
matched token ~20%, and one rate for both either cuts the sure runs short or verifies the guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from specdec.speculative.costs import AcceptanceEstimate, CostModel, default_clock, expected_tokens


class FixedK:
    """Always draft K tokens (speculation off when K = 0)."""

    adaptive = False
    decay = 1.0  # acceptance estimates keep every verdict

    def __init__(self, k: int) -> None:
        self.k_max = k

    def choose(self, estimates: list[AcceptanceEstimate], costs: CostModel, remaining: list[int] | None = None,
               restart_tokens: int = 0) -> list[int]:
        return [self.k_max] * len(estimates)


class AdaptiveK:
    """One K for the batch: the one that maximises expected tokens per second at its size."""

    adaptive = True

    def __init__(self, k_max: int, probe_interval: int = 16, max_probe_interval: int = 256,
                 decay: float = 0.9, probe_rate: float = 0.9, switch_margin: float = 1.1) -> None:
        self.k_max = k_max
        self.switch_margin = switch_margin
        self.on = False  # the last step speculated (not as a probe)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.decay = decay
        self.probe_rate = probe_rate
        self.steps_off = 0  # steps since speculation was last on (or probed)
        self.steps_on = 0  # steps speculation has been on in a row
        self.probe_every = probe_interval  # steps between probes while off; doubles while probes lose
        self.probing = False  # this step's draft is a probe

    def best_k(self, rates: list[float], costs: CostModel, margin: float = 1.0) -> int:
        """The K with the most expected tokens per second for a batch with these acceptance rates, 0 unless
        it beats plain decoding by the factor `margin`; -1 when nothing is measured yet."""
        B = len(rates)
        t_draft = costs.draft_time(B)
        t_plain = costs.verify_time(B)
        if t_draft is None or t_plain is None:
            return -1
        best_k, best_rate = 0, margin * B / t_plain
        for k in range(1, self.k_max + 1):
            rate = sum(expected_tokens(a, k) for a in rates) / (k * t_draft + costs.verify_time(B * (k + 1)))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def next_k(self, rates: list[float], costs: CostModel) -> int:
        """`best_k` with hysteresis: switching speculation on costs the draft a catch-up the formula does not
        count, and the estimates are noisy, so from off only a clear gain (`switch_margin`) turns it on;
        once on, any gain keeps it on."""
        return self.best_k(rates, costs, 1.0 if self.on else self.switch_margin)

    def prompt_pays(self, rates: list[float], costs: CostModel, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a draft model should read a joining prompt of `prompt_tokens` tokens; `rates` are the
        batch's acceptance rates, the joining sequence's last. Yes if nothing is measured yet (its first
        steps measure the draft, with its context), or if the batch will speculate and, for the
        `output_tokens` the sequence may generate, the batch's time per token of this sequence under the
        best K beats plain decoding's by more than the reading costs. (Without the prompt the draft restarts
        on a short window, which agrees less: speculation for this row is then counted as lost.)"""
        k = self.next_k(rates, costs)
        if k < 0:
            return True
        if k == 0:
            return False
        reading = costs.draft_prefill_time(prompt_tokens)
        if reading is None:
            return True
        return output_tokens * self._saving_per_token(costs, len(rates), k, rates[-1]) > reading

    @staticmethod
    def _saving_per_token(costs: CostModel, batch_size: int, k: int, rate: float) -> float:
        """Batch time saved per output token of one sequence by drafting k tokens at acceptance `rate`:
        plain decoding gives it one token per pass, speculation E(rate, k) per (k drafts + a wider pass)."""
        B = batch_size
        spec = (k * costs.draft_time(B) + costs.verify_time(B * (k + 1))) / expected_tokens(rate, k)
        return costs.verify_time(B) - spec

    def probe_pays(self, costs: CostModel, batch_size: int, remaining: list[int] | None = None,
                   restart_tokens: int = 0) -> bool:
        """Whether a probe could pay at this batch size: acceptance `probe_rate` would switch speculation on,
        and what that saves over the mean `remaining` output tokens of the batch exceeds the probe's cost
        (a draft step, the pass's extra rows, re-reading `restart_tokens` per row). Without `remaining`,
        the first condition only."""
        B = batch_size
        k = self.best_k([self.probe_rate] * B, costs, self.switch_margin)
        if k <= 0:
            return False
        if not remaining:
            return True
        saving = sum(remaining) / len(remaining) * self._saving_per_token(costs, B, k, self.probe_rate)
        restart = costs.draft_prefill_time(B * restart_tokens) or 0.0
        cost = costs.draft_time(B) + costs.verify_time(2 * B) - costs.verify_time(B) + restart
        return saving > cost

    def choose(self, estimates: list[AcceptanceEstimate], costs: CostModel, remaining: list[int] | None = None,
               restart_tokens: int = 0) -> list[int]:
        """One K for the batch (all entries equal). `remaining`: each sequence's output tokens still to come
        (they bound what a probe can win); `restart_tokens`: what a draft model re-reads per row when it
        restarts (its window)."""
        k = self.next_k([est.rate for est in estimates], costs)
        self.on = k > 0
        self.probing = False
        if k < 0:  # nothing measured yet: one cheap probe (K = 1) measures a draft step and a 2-row pass
            k, self.probing = 1, True
        elif k > 0:
            self.steps_off, self.steps_on = 0, self.steps_on + 1
            if self.steps_on >= self.probe_interval:  # it has paid for a while: notice the next change quickly
                self.probe_every = self.probe_interval
        else:
            self.steps_on = 0
            self.steps_off += 1
            if self.steps_off >= self.probe_every and \
                    self.probe_pays(costs, len(estimates), remaining, restart_tokens):
                self.steps_off = 0  # probe: is the draft agreeing again?
                self.probe_every = min(2 * self.probe_every, self.max_probe_interval)
                k, self.probing = 1, True
        return [k] * len(estimates)


class KindRates:
    """Acceptance rate of drafted tokens by kind of guess: decayed counts of the tokens of each kind that were
    verified (reached: every token before them accepted) and of those accepted, from a prior of `prior` worth
    `weight` tokens. Every step multiplies all counts by `forget`, so a kind not verified for a while (its
    tokens cut because its rate was low) drifts back to the prior and is tried again.

    What the text at hand makes of them is each sequence's `lean` (`AcceptanceEstimate.lean`): its tokens'
    acceptance over what their kinds' rates expected, decayed by `lean_decay` a step; a sequence's rate for a
    kind is the kind's rate times its lean (at most 1). Measured (suffix decoding, the default pair): a token
    after one matched token was accepted 31% of the time in code edits, 18% in answers to HumanEval and
    Spec-Bench prompts; after 8-15 matched tokens 95% and 89%.
    """

    def __init__(self, kinds: int, prior: float = 0.7, weight: float = 1.0, forget: float = 0.995,
                 lean_decay: float = 0.95) -> None:
        self.prior, self.weight, self.forget, self.lean_decay = prior, weight, forget, lean_decay
        self.tried = [0.0] * kinds
        self.accepted = [0.0] * kinds

    def rate(self, kind: int) -> float:
        return (self.accepted[kind] + self.weight * self.prior) / (self.tried[kind] + self.weight)

    def learn(self, kinds: list[int], accepted: int, estimate: AcceptanceEstimate) -> None:
        """A chain of these kinds whose first `accepted` tokens were accepted (the next one, if any, rejected),
        drafted for the sequence of `estimate`."""
        tried = kinds[:accepted + 1]
        d = self.lean_decay
        estimate.kind_accepted = estimate.kind_accepted * d + accepted
        estimate.kind_expected = estimate.kind_expected * d + sum(self.rate(k) for k in tried)
        for i, kind in enumerate(tried):
            self.tried[kind] += 1.0
            self.accepted[kind] += 1.0 if i < accepted else 0.0

    def relax(self, estimate: AcceptanceEstimate) -> None:
        """A step in which none of the sequence's labelled tokens were verified: its lean decays as in a step
        that learns, toward 1. Otherwise a sequence whose first drafts missed keeps the lean that cuts all its
        later drafts and never drafts again to mend it (seen: a code edit decoded with no draft at all after
        two 1-token misses, where its trie's drafts made 3.3 tokens a pass in the run beside it)."""
        estimate.kind_accepted *= self.lean_decay
        estimate.kind_expected *= self.lean_decay

    def step(self) -> None:
        f = self.forget
        self.tried = [t * f for t in self.tried]
        self.accepted = [a * f for a in self.accepted]


class ByKind:
    """Adaptive for drafts of labelled tokens (see the module's docstring): the proposer drafts up to K_max,
    then `width` cuts the batch's drafts to the width with the most expected tokens per second: sequence i's
    draft cut to W tokens is expected to emit E_i(W) = 1 + sum_{j <= W} prod_{l <= j} rate_i(kind_il), and
    the pass costs t_verify(B * (W + 1)) (`CostModel.pass_time`: a line fitted to every pass measured).
    Example: rates 0.97 for 12 tokens, 12% of a pass per row: the whole run (E = 9.7, 2.44 pass-times);
    after one matched token (rate 0.2) nothing: 1.2 tokens for 1.12."""

    adaptive = True
    decay = 0.9  # of the per-sequence estimates (new sequences' prior), as AdaptiveK's

    def __init__(self, k_max: int, kinds: int) -> None:
        self.k_max = k_max
        self.rates = KindRates(kinds)

    def choose(self, estimates: list[AcceptanceEstimate], costs: CostModel, remaining: list[int] | None = None,
               restart_tokens: int = 0) -> list[int]:
        return [self.k_max] * len(estimates)

    def prompt_pays(self, rates: list[float], costs: CostModel, prompt_tokens: int, output_tokens: int) -> bool:
        return False  # its proposers read no prompts: they draft from what the sequence holds

    def width(self, drafts: list[list[int]], leans: list[float], costs: CostModel) -> int:
        """The draft width (tokens per sequence, at most the longest draft) for a batch whose drafts have
        these kinds, drafted for sequences of these leans: all of it before a target pass has been measured
        at this batch size."""
        B, widest = len(drafts), max(map(len, drafts), default=0)
        if widest == 0 or costs.pass_time(B) is None:
            return widest
        reach = [1.0] * B  # the probability that each draft's tokens so far are all accepted
        tokens = float(B)  # expected tokens of the pass, drafts cut at w
        best_w, best = 0, tokens / costs.pass_time(B)
        for w in range(1, widest + 1):
            for b, kinds in enumerate(drafts):
                if w <= len(kinds):
                    reach[b] *= min(1.0, self.rates.rate(kinds[w - 1]) * leans[b])
                    tokens += reach[b]
            rate = tokens / costs.pass_time(B * (w + 1))
            if rate > best:
                best_w, best = w, rate
        return best_w


class Outcome(NamedTuple):
    """One judged sequence's draft in a step: its estimate, the draft's depth, the tokens accepted of it."""

    estimate: AcceptanceEstimate
    depth: int
    accepted: int


class LabelledOutcome(NamedTuple):
    """One judged labelled draft (`Draft.kinds`): its sequence's estimate, its tokens' kinds, those accepted."""

    estimate: AcceptanceEstimate
    kinds: list[int]
    accepted: int


class PassRows(NamedTuple):
    """A target pass's rows (all it computed) and its seconds (`CostModel.record_pass`)."""

    rows: int
    seconds: float


@dataclass
class StepReport:
    """What the engine tells the controller after a decoding step."""

    batch_size: int
    k: int  # the K chosen for the step (the widest chain asked for)
    forward_seconds: float | None  # one drafting forward (the proposal's measure); None: not measured
    rows: int  # rows in the target pass (batch size x its width)
    verify_seconds: float | None  # None: not a measure of those rows (a joining prompt's rode in the pass)
    outcomes: list[Outcome]  # each judged sequence's
    kinds: list[LabelledOutcome] = field(default_factory=list)  # each judged labelled draft's
    ride: PassRows | None = None  # a pass that a joining prompt's rows rode in


class SpeculationController:
    """The whole speculation policy, asked one question per step (`choose`) and told one report (`report`):
    the K policy (fixed or adaptive), the measured costs, the acceptance estimates and their decay, the
    batch size past which speculation is off (`disable_by_batch_size`, vLLM's
    `--speculative-disable-by-batch-size`), probes, and whether a draft model reads a joining prompt.

    `restart_tokens`: what a drafting row re-reads when speculation resumes after a pause (a draft
    model's window), a cost a probe must pay for. `clock`: the engine's, which the proposers read too
    (default: perf_counter after a GPU's queued work).
    """

    def __init__(self, k_max: int, adaptive: bool = False, disable_by_batch_size: int | None = None,
                 restart_tokens: int = 0, guess_kinds: int = 0, clock: Callable[[], float] | None = None) -> None:
        if adaptive and k_max > 0:
            self.policy = ByKind(k_max, guess_kinds) if guess_kinds else AdaptiveK(k_max)
        else:
            self.policy = FixedK(k_max)
        self.costs = CostModel()
        self.acceptance = AcceptanceEstimate()  # over all sequences: the prior of new ones
        # over the sequences whose prompt a draft model read: the prior of those (a draft restarted on a short
        # window agrees less, and must not talk the controller out of reading prompts); None: none judged yet
        self.with_prompt: AcceptanceEstimate | None = None
        self.disable_by_batch_size = disable_by_batch_size
        self.restart_tokens = restart_tokens
        self._draft_warm: set[int] = set()  # batch sizes at which the drafter has run once
        self.clock = clock or default_clock  # what every part of a step is timed with, the proposers' parts too

    @classmethod
    def for_proposer(cls, proposer, k_max: int, adaptive: bool = False, disable_by_batch_size: int | None = None,
                     clock: Callable[[], float] | None = None) -> "SpeculationController":
        """The controller of `proposer` (bound to it): no K for a proposer that never drafts, and the policy its
        drafts call for (`ByKind` for labelled tokens)."""
        k = k_max if proposer.max_width(k_max) > 0 else 0
        controller = cls(k, adaptive, disable_by_batch_size, proposer.restart_tokens, proposer.guess_kinds, clock)
        proposer.bind(controller)
        return controller

    @property
    def k_max(self) -> int:
        return self.policy.k_max

    @property
    def decay(self) -> float:
        return self.policy.decay

    # the acceptance assumed for a draft model reading its first prompt (before any such row is judged): a
    # draft of the target's family, with the whole context; on the default pair 0.84-0.98 was measured
    PROMPT_PRIOR = 0.9

    def new_estimate(self, read_prompt: bool = False) -> AcceptanceEstimate:
        """A joining sequence's estimate: what earlier sequences measured, weakly; for one whose prompt a draft
        model reads, what earlier such sequences measured."""
        if read_prompt:
            rate = self.PROMPT_PRIOR if self.with_prompt is None else self.with_prompt.rate
            return replace(AcceptanceEstimate.with_prior(rate), read_prompt=True)
        return AcceptanceEstimate.with_prior(self.acceptance.rate)

    def _disabled(self, batch_size: int) -> bool:
        return self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size

    def choose(self, estimates: list[AcceptanceEstimate], remaining: list[int], room: list[int],
               contexts: list[int] | None = None) -> list[int]:
        """K for each sequence of the batch this step. `remaining`: output tokens each may still emit;
        `room`: context slots each has left. A pass emits K + 1 tokens, so K never exceeds either less one.
        `contexts`: each one's tokens so far: the step is costed (and its pass recorded) at their mean depth."""
        if contexts:
            self.costs.at(sum(contexts) // len(contexts))
        if self._disabled(len(estimates)):
            return [0] * len(estimates)
        ks = self.policy.choose(estimates, self.costs, remaining=remaining, restart_tokens=self.restart_tokens)
        return [max(0, min(k, r - 1, c - 1)) for k, r, c in zip(ks, remaining, room)]

    def cut(self, drafts: list, estimates: list[AcceptanceEstimate]) -> list:
        """The drafts (`Draft`s) as this step verifies them, for sequences of these estimates: with `ByKind`,
        chains of labelled tokens cut to the width that pays (see `ByKind.width`); otherwise as they are."""
        if not isinstance(self.policy, ByKind) or any(d.tokens and d.kinds is None for d in drafts):
            return drafts
        w = self.policy.width([d.kinds or [] for d in drafts], [e.lean for e in estimates], self.costs)
        return [d if len(d.tokens) <= w else
                replace(d, tokens=d.tokens[:w], kinds=d.kinds[:w], probs=None if d.probs is None else d.probs[:w])
                for d in drafts]

    def report(self, step: StepReport) -> None:
        """Record a step's costs and each judged sequence's acceptance (its own estimate and the prior; with
        `ByKind`, its tokens' rates by kind)."""
        if step.k > 0 and step.forward_seconds is not None:
            # a drafter's first forward at a batch size pays one-off costs (a draft model's weights paged in from
            # their memory map, buffers grown): measured 0.9 of a target pass against 0.45 after, it had kept the
            # adaptive draft off for good. It is not taken as a measure; the next step probes again.
            if step.batch_size in self._draft_warm:
                self.costs.record_draft(step.batch_size, step.forward_seconds)
            self._draft_warm.add(step.batch_size)
        if step.verify_seconds is not None:
            self.costs.record_verify(step.rows, step.verify_seconds)
        if step.ride is not None:
            self.costs.record_pass(step.ride.rows, step.ride.seconds)
        for o in step.outcomes:
            o.estimate.update(o.depth, o.accepted, self.decay)
            self.acceptance.update(o.depth, o.accepted, self.decay)
            if o.estimate.read_prompt and o.depth > 0:
                if self.with_prompt is None:  # the prior, worth one drafted token
                    self.with_prompt = AcceptanceEstimate.with_prior(self.PROMPT_PRIOR, weight=1.0)
                self.with_prompt.update(o.depth, o.accepted, self.decay)
        if isinstance(self.policy, ByKind):
            self.policy.rates.step()
            for o in step.kinds:
                self.policy.rates.learn(o.kinds, o.accepted, o.estimate)
            learned = {id(o.estimate) for o in step.kinds}
            for o in step.outcomes:
                if id(o.estimate) not in learned:
                    self.policy.rates.relax(o.estimate)

    def record_prefill(self, model: str, tokens: int, seconds: float) -> None:
        self.costs.record_prefill(model, tokens, seconds)

    def draft_reads_prompt(self, estimates: list[AcceptanceEstimate], batch_size: int, prompt_tokens: int,
                           output_tokens: int) -> bool:
        """Whether a draft model should read a joining prompt of `prompt_tokens` tokens (otherwise a later
        speculative step restarts the draft on a short window). `estimates`: the running sequences';
        `batch_size`: the batch the joining one will be in (new ones at the acceptance of sequences whose
        prompt was read, `PROMPT_PRIOR` before any). Fixed K: yes unless speculation is off. Adaptive: if
        nothing is measured yet, or if K > 0 wins for that batch and the time saved over `output_tokens`
        exceeds the reading (`AdaptiveK.prompt_pays`)."""
        if self._disabled(batch_size):
            return False
        if not self.policy.adaptive:
            return self.k_max > 0
        joining = self.PROMPT_PRIOR if self.with_prompt is None else self.with_prompt.rate
        rates = [e.rate for e in estimates] + [joining] * (batch_size - len(estimates))
        return self.policy.prompt_pays(rates, self.costs, prompt_tokens, output_tokens)
