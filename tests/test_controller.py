"""Choosing K: Leviathan's expected-tokens formula, the acceptance estimate, the cost model, fixed and
adaptive K; and, on a tiny model, an adaptive engine with a degraded draft that stops drafting."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, varied_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.speculative.costs import AcceptanceEstimate, CostModel, LineFit, expected_tokens
from specdec.speculative.controller import AdaptiveK, ByKind, FixedK, KindRates, LabelledOutcome, Outcome, \
    SpeculationController, StepReport
from specdec.speculative.proposers import Draft, SuffixProposer
from specdec.testing.degraded import PermutedLogitsModel
from specdec.speculative.draft_model import DraftModelProposer

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)


# ------------------------------------------------------------------------------------------- formula
@pytest.mark.parametrize(
    "a,k,expected",
    [
        (0.0, 0, 1.0), (0.0, 5, 1.0),  # nothing accepted: the recovered token only
        (1.0, 0, 1.0), (1.0, 3, 4.0), (1.0, 8, 9.0),  # everything accepted: K + bonus
        (0.5, 1, 1.5), (0.5, 2, 1.75), (0.5, 3, 1.875),
        (0.8, 5, (1 - 0.8 ** 6) / 0.2),  # 3.68928
        (0.8, 8, (1 - 0.8 ** 9) / 0.2),  # 4.32891
        (0.9, 4, 1 + 0.9 + 0.81 + 0.729 + 0.6561),
    ],
)
def test_expected_tokens(a, k, expected):
    assert expected_tokens(a, k) == pytest.approx(expected, rel=1e-12)


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.1, 0.37, 0.99):
        for k in range(9):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)), rel=1e-12)


def test_docstring_example():
    # a = 0.8, draft cost 0.1 of a pass: E(5) = 3.69 tokens in 1.5 pass-times beats K = 0 and K = 8
    assert expected_tokens(0.8, 5) == pytest.approx(3.69, abs=0.005)
    assert expected_tokens(0.8, 5) / 1.5 == pytest.approx(2.46, abs=0.005)
    assert expected_tokens(0.8, 8) / 1.8 == pytest.approx(2.405, abs=0.001)  # the docstring rounds to 2.41
    assert expected_tokens(0.8, 5) / 1.5 > expected_tokens(0.8, 8) / 1.8 > 1.0


# ------------------------------------------------------------------------------------------- estimate, costs
def test_acceptance_estimate():
    est = AcceptanceEstimate()
    assert est.rate == pytest.approx(0.6)  # the weak prior
    est.update(num_drafted=0, num_accepted=0, decay=0.5)  # no draft: no information
    assert est.rate == pytest.approx(0.6)
    est.update(num_drafted=3, num_accepted=3, decay=1.0)  # all accepted: no rejection
    assert (est.accepted, est.rejections) == pytest.approx((4.8, 1.2))
    est.update(num_drafted=4, num_accepted=1, decay=0.5)  # one accepted, then a rejection
    assert (est.accepted, est.rejections) == pytest.approx((3.4, 1.6))
    assert est.rate == pytest.approx(3.4 / 5.0)
    for _ in range(60):  # a draft that never agrees: the rate decays to ~0
        est.update(num_drafted=5, num_accepted=0, decay=0.9)
    assert est.rate < 0.01


def test_cost_model_smoothing_and_estimates_between_and_beyond_measured_sizes():
    costs = CostModel(smoothing=0.5)
    assert costs.draft_time(1) is None and costs.verify_time(1) is None
    costs.record_draft(1, 2.0)
    costs.record_draft(1, 4.0)
    assert costs.draft_time(1) == pytest.approx(3.0)
    # one measurement: + prior_slope (0.5) of it per its size, between flat and proportional
    assert costs.draft_time(2) == pytest.approx(4.5) and costs.draft_time(4) == pytest.approx(7.5)
    costs.record_verify(2, 10.0)
    assert costs.verify_time(1) == pytest.approx(7.5) and costs.verify_time(6) == pytest.approx(20.0)
    costs.record_verify(1, 9.0)
    costs.record_verify(6, 13.0)
    assert costs.verify_time(1) == 9.0 and costs.verify_time(6) == 13.0  # measured
    assert costs.verify_time(4) == pytest.approx(11.5)  # between 2 (10.0) and 6 (13.0)
    assert costs.verify_time(10) == pytest.approx(16.0)  # beyond: the line through 2 and 6, 0.75 per row
    costs = CostModel()
    costs.record_verify(4, 4.0)
    costs.record_verify(8, 4.0)
    assert costs.verify_time(12) == 4.0 and costs.verify_time(2) == 4.0  # flat: more rows never cost less
    costs = CostModel()
    costs.record_verify(4, 1.0)
    costs.record_verify(8, 7.2)  # noise: a steep line (1.55 per row), kept within proportional scaling
    assert costs.verify_time(16) == pytest.approx(14.4)  # not 7.2 + 1.55 * 8 = 19.6
    assert costs.verify_time(1) == pytest.approx(0.25)  # not 1.0 - 1.55 * 3 < 0


def test_a_stale_slow_measurement_of_fewer_rows_does_not_keep_a_useless_draft_on():
    """One slow 1-row pass (a hiccup) measured before speculation turned on is never measured again while
    the controller drafts; estimated above the 2-row pass, it made drafting look cheaper than plain
    decoding even at acceptance 0, and speculation stayed on for good."""
    costs = costs_with(draft=0.1, verify={1: 3.0, 2: 1.2})
    assert costs.verify_time(1) == pytest.approx(1.2)  # capped by the larger measured size
    ctl = AdaptiveK(k_max=4)
    ctl.on = True  # speculation is on: any gain would keep it on
    assert ctl.best_k([0.0], costs) == 0
    assert ctl.choose([AcceptanceEstimate(accepted=0.0, rejections=5.0)], costs) == [0]


def test_pass_costs_are_kept_by_context_depth():
    """A pass's cost is kept by depth band; a band measured at one width takes the shape of the nearest band
    measured at several (the docstring's example); a band measured at none, that band's costs."""
    costs = CostModel()
    costs.at(300)
    costs.record_verify(1, 1.0)
    costs.record_verify(4, 1.2)
    costs.at(8000)
    assert costs.verify_time(4) == pytest.approx(1.2)  # nothing at 8k yet: the shallow band's
    costs.record_verify(1, 2.0)
    assert costs.verify_time(4) == pytest.approx(2.4) and costs.pass_time(4) == pytest.approx(2.4)
    costs.record_verify(4, 3.0)  # measured at 8k: its own
    assert costs.verify_time(4) == pytest.approx(3.0) and costs.pass_time(2) == pytest.approx(2 + 1 / 3)
    costs.at(500)  # back at the shallow band: its costs unchanged
    assert costs.verify_time(4) == pytest.approx(1.2) and costs.verify_time(1) == pytest.approx(1.0)


def test_speculation_is_gated_by_the_depth_of_the_batch():
    """Passes of 6 rows cost 1.2 one-row passes at 500 tokens of context, but at 8k 2 rows cost 1.6 and 6
    rows 4 (attention over the context for each row): at acceptance 0.5, the controller drafts at 500 tokens
    and not at 8k, whether it drafted the step before or not, each step costed at the depth it names
    (`choose(..., contexts)`)."""
    ctl = SpeculationController(5, adaptive=True)
    for context, verify in ((500, {1: 1.0, 6: 1.2}), (8000, {1: 2.0, 2: 3.2, 6: 8.0})):
        ctl.costs.at(context)
        for _ in range(2):
            ctl.costs.record_draft(1, 0.01)
            for rows, t in verify.items():
                ctl.costs.record_verify(rows, t)
    halfway = [AcceptanceEstimate(accepted=5.0, rejections=5.0)]
    assert halfway[0].rate == pytest.approx(0.5)
    assert ctl.choose(halfway, [100], [100], contexts=[8000]) == [0]
    assert ctl.choose(halfway, [100], [100], contexts=[500])[0] >= 2
    assert ctl.choose(halfway, [100], [100], contexts=[8100]) == [0]


# ------------------------------------------------------------------------------------------- fixed and adaptive K
def costs_with(draft: float, verify: dict[int, float] | float, batch_size: int = 1) -> CostModel:
    costs = CostModel()
    costs.record_draft(batch_size, draft)
    table = verify if isinstance(verify, dict) else {batch_size * r: verify for r in range(1, 10)}
    for rows, t in table.items():
        costs.record_verify(rows, t)
    return costs


def test_fixed_k():
    assert FixedK(4).choose([AcceptanceEstimate() for _ in range(3)], CostModel()) == [4, 4, 4]
    assert FixedK(0).choose([AcceptanceEstimate()], CostModel()) == [0]
    assert not FixedK(4).adaptive and AdaptiveK(4).adaptive


def test_adaptive_probes_to_measure_when_nothing_is_measured():
    """No costs yet: a cheap probe (K = 1) rather than K_max, which would cost a full draft of a possibly
    useless draft; once a draft step and 1- and 2-row passes are measured, a good draft gets the longest K
    (longer passes estimated along the line through those two)."""
    ctl = AdaptiveK(5)
    assert ctl.choose([AcceptanceEstimate()], CostModel()) == [1] and ctl.probing
    costs = CostModel()
    costs.record_draft(1, 0.05)
    costs.record_verify(1, 1.0)
    costs.record_verify(2, 1.05)
    assert ctl.choose([AcceptanceEstimate.with_prior(0.9)], costs) == [5] and not ctl.probing


def test_adaptive_turns_off_when_acceptance_is_near_zero_and_drafting_costs():
    # a draft forward costs half a target pass; acceptance ~0: every K > 0 loses to plain decoding
    costs = costs_with(draft=0.5, verify=1.0)
    for a in (0.0, 0.02, 0.1):
        assert AdaptiveK(8).best_k([a], costs) == 0


def test_adaptive_takes_k_max_when_acceptance_is_high_and_drafting_cheap():
    costs = costs_with(draft=0.01, verify=1.0)
    for a in (0.95, 0.99, 1.0):
        assert AdaptiveK(8).best_k([a], costs) == 8


def test_adaptive_picks_the_rate_maximising_k():
    # a = 0.8, draft 0.1 of a pass, verification cost flat in rows: E(K) / (1 + 0.1 K) peaks at K = 6
    costs = costs_with(draft=0.1, verify=1.0)
    rates = {k: expected_tokens(0.8, k) / (1 + 0.1 * k) for k in range(1, 9)}
    assert max(rates, key=rates.get) == 6
    assert AdaptiveK(8).best_k([0.8], costs) == 6
    assert AdaptiveK(4).best_k([0.8], costs) == 4  # capped by K_max
    # verification that grows with rows shortens the best K: t_verify(r) = 1 + 0.2 (r - 1)
    costs = costs_with(draft=0.1, verify={r: 1 + 0.2 * (r - 1) for r in range(1, 10)})
    rates = {k: expected_tokens(0.8, k) / (0.1 * k + 1 + 0.2 * k) for k in range(1, 9)}
    assert AdaptiveK(8).best_k([0.8], costs) == max(rates, key=rates.get) == 3
    # the same, estimated from 1- and 2-row passes only (the line through them)
    costs = costs_with(draft=0.1, verify={1: 1.0, 2: 1.2})
    assert AdaptiveK(8).best_k([0.8], costs) == 3


def test_adaptive_uses_the_batch_size_costs():
    # at batch size 1 drafting is cheap, at batch size 2 the draft forward costs as much as a pass
    costs = costs_with(draft=0.01, verify=1.0, batch_size=1)
    costs.record_draft(2, 1.0)
    ctl = AdaptiveK(4)
    assert ctl.best_k([0.7], costs) == 4
    assert ctl.best_k([0.7, 0.7], costs) == 0


def test_adaptive_chooses_one_k_for_the_batch_from_all_its_rates():
    """Rows are padded to the widest draft, so K is the batch's: the one with the most expected tokens of
    all rows per second. One good sequence carries a batch of poor ones only if its gain outweighs theirs."""
    costs = costs_with(draft=0.1, verify={r: 1 + 0.1 * (r - 1) for r in range(1, 40)})
    ctl = AdaptiveK(5, probe_interval=100)
    good, bad = AcceptanceEstimate(accepted=99.0, rejections=1.0), AcceptanceEstimate(accepted=0.0, rejections=9.0)
    k = ctl.choose([good, bad], costs)[0]
    assert ctl.choose([good, bad], costs) == [k, k] and k > 0
    rates = {k: sum(expected_tokens(e.rate, k) for e in (good, bad)) / (0.1 * k + 1 + 0.1 * (2 * (k + 1) - 1))
             for k in range(1, 6)}
    assert k == max(rates, key=rates.get) and rates[k] > 2 / 1.1
    assert ctl.choose([good] + [bad] * 5, costs) == [0] * 6


def test_adaptive_probes_while_off_with_a_doubling_interval():
    ctl = AdaptiveK(6, probe_interval=5, max_probe_interval=20)
    costs = costs_with(draft=0.5, verify=1.0)
    est = AcceptanceEstimate(accepted=0.0, rejections=10.0)
    ks, probing = [], []
    for _ in range(75):
        ks.append(ctl.choose([est], costs)[0])
        probing.append(ctl.probing)
    probes = [i + 1 for i, k in enumerate(ks) if k]
    assert set(ks) == {0, 1} and [i + 1 for i, p in enumerate(probing) if p] == probes
    assert probes == [5, 15, 35, 55, 75]  # after 5, 10, 20, then at most 20 steps
    # a probe that is accepted raises the estimate; once drafting wins again the controller speculates
    cheap = costs_with(draft=0.01, verify=1.0)
    est = AcceptanceEstimate(accepted=0.0, rejections=10.0)
    assert ctl.choose([est], cheap) == [0]
    for _ in range(10):
        est.update(num_drafted=1, num_accepted=1, decay=ctl.decay)
    assert ctl.choose([est], cheap)[0] > 0 and not ctl.probing
    # the interval resets once speculation has stayed on for probe_interval steps, not at once: a probe
    # that turns it on for a step or two counts as a losing one
    assert (ctl.steps_off, ctl.probe_every) == (0, 20)
    for _ in range(3):
        assert ctl.choose([est], cheap)[0] > 0
    assert ctl.probe_every == 20
    assert ctl.choose([est], cheap)[0] > 0 and ctl.probe_every == 5


def test_adaptive_turns_speculation_on_only_for_a_clear_gain_and_keeps_it_while_it_gains():
    """Hysteresis: a 5% gain over plain decoding does not switch speculation on (switching costs the draft
    a catch-up, and the estimates are noisy), a 20% gain does; once on, a 5% gain keeps it on."""
    costs = costs_with(draft=0.5, verify=1.0)  # K = 1 at acceptance a: (1 + a) / 1.5 tokens per pass-time
    small, clear = AcceptanceEstimate.with_prior(0.575), AcceptanceEstimate.with_prior(0.8)
    assert (1 + 0.575) / 1.5 == pytest.approx(1.05) and (1 + 0.8) / 1.5 == pytest.approx(1.2)
    ctl = AdaptiveK(1, probe_interval=1000)
    assert ctl.best_k([small.rate], costs) == 1  # the best K without a margin
    assert ctl.choose([small], costs) == [0] and not ctl.on
    assert ctl.choose([clear], costs) == [1] and ctl.on
    assert ctl.choose([small], costs) == [1] and ctl.on
    assert ctl.choose([AcceptanceEstimate.with_prior(0.45)], costs) == [0] and not ctl.on  # a loss: off


def test_adaptive_does_not_probe_where_speculation_cannot_pay():
    """At a batch size where even acceptance `probe_rate` would not beat plain decoding (verification
    costs in proportion to rows, drafting is not free), probing could find nothing: it never happens."""
    ctl = AdaptiveK(5, probe_interval=2)
    costs = costs_with(draft=0.2, verify={r: 0.1 * r for r in range(8, 60)}, batch_size=8)
    ests = [AcceptanceEstimate(accepted=0.0, rejections=10.0) for _ in range(8)]
    assert all(ctl.choose(ests, costs) == [0] * 8 for _ in range(50)) and ctl.best_k([0.9] * 8, costs) == 0
    # where verification is nearly free, the same batch is probed (K = 1 every 2, 4, 8, ... steps)
    cheap = costs_with(draft=0.05, verify={r: 1 + 0.01 * r for r in range(8, 60)}, batch_size=8)
    ctl = AdaptiveK(5, probe_interval=2)
    assert [i + 1 for i in range(20) if ctl.choose(ests, cheap) == [1] * 8] == [2, 6, 14]


def test_adaptive_does_not_probe_where_a_probe_could_not_switch_speculation_on():
    """A batch where even acceptance `probe_rate` gains less than the switch margin over plain decoding (here
    5% at one sequence: a draft forward costing half a target pass) is never probed: whatever a probe
    measured, speculation would stay off. With a margin of 1.0, the same costs are probed."""
    costs = costs_with(draft=0.5, verify={1: 1.0, 2: 1.0, 3: 1.4, 4: 1.8, 5: 2.2, 6: 2.6})
    assert 1.9 / 1.5 / 1.0 > 1.1  # K = 1 at acceptance 0.9 would gain 27%: probed
    ests = [AcceptanceEstimate(accepted=0.0, rejections=10.0)]
    ctl = AdaptiveK(5, probe_interval=2)
    assert [i + 1 for i in range(10) if ctl.choose(ests, costs) == [1]] == [2, 6]
    slow = costs_with(draft=0.75, verify={1: 1.0, 2: 1.0, 3: 1.4, 4: 1.8, 5: 2.2, 6: 2.6})
    ctl = AdaptiveK(5, probe_interval=2)
    assert ctl.best_k([0.9], slow) == 1 and 1.0 < 1.9 / 1.75 < 1.1  # a gain of 8.6%: under the margin
    assert all(ctl.choose(ests, slow) == [0] for _ in range(50))
    ctl = AdaptiveK(5, probe_interval=2, switch_margin=1.0)
    assert [i + 1 for i in range(10) if ctl.choose(ests, slow) == [1]] == [2, 6]


def test_a_probe_is_made_only_where_the_remaining_output_can_pay_for_it():
    """At acceptance 0.9 K = 5 would emit 4.69 tokens per 2.5 pass-times: 0.467 pass-time saved per token.
    A probe costs a draft step (0.1), the wider pass (0.2) and the restart on a 16-token window (1.6 at
    0.1 a token): 1.9, repaid by 5 remaining tokens, not by 4. Without a restart, 1 token repays it."""
    costs = costs_with(draft=0.1, verify={1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8, 6: 2.0})
    costs.record_prefill("draft", 100, 10.0)
    ctl = AdaptiveK(5, probe_interval=1)
    assert ctl.best_k([0.9], costs) == 5 and expected_tokens(0.9, 5) == pytest.approx(4.69, abs=0.01)
    assert not ctl.probe_pays(costs, 1, remaining=[4], restart_tokens=16)
    assert ctl.probe_pays(costs, 1, remaining=[5], restart_tokens=16)
    assert ctl.probe_pays(costs, 1, remaining=[1], restart_tokens=0)
    assert ctl.probe_pays(costs, 1)  # nothing known of the output: only the margin counts
    ests = [AcceptanceEstimate(accepted=0.0, rejections=10.0)]
    assert all(ctl.choose(ests, costs, remaining=[4], restart_tokens=16) == [0] for _ in range(10))
    assert ctl.choose(ests, costs, remaining=[5], restart_tokens=16) == [1] and ctl.probing


def test_draft_prefill_time_is_measured_or_scaled_from_the_target():
    costs = CostModel()
    assert costs.draft_prefill_time(100) is None
    costs.record_prefill("target", 100, 3.0)  # 30 ms a token
    assert costs.draft_prefill_time(100) is None  # no draft/target ratio yet
    costs.record_draft(1, 0.05)
    costs.record_verify(1, 0.15)
    assert costs.draft_prefill_time(100) == pytest.approx(1.0)  # a third of the target's, like one forward
    costs.record_prefill("draft", 50, 0.6)
    assert costs.draft_prefill_time(100) == pytest.approx(1.2)  # measured wins
    costs.record_prefill("draft", 0, 0.0)  # nothing read: nothing recorded
    assert costs.draft_prefill_time(100) == pytest.approx(1.2)


def test_a_draft_reads_a_joining_prompt_only_where_the_time_saved_exceeds_the_reading():
    """K = 1 at acceptance 0.9 with a draft forward at 0.1 of a pass: a token of this sequence costs
    1.1 / 1.9 = 0.58 pass instead of 1, saving 0.42 pass a token. A prompt the draft reads in 10 passes pays
    for 32 output tokens (13.5 passes saved), not for 16 (6.7); and never where speculation is off."""
    costs = costs_with(draft=0.1, verify=1.0)
    costs.record_prefill("draft", 100, 10.0)
    ctl = AdaptiveK(1)
    assert ctl.prompt_pays([0.9], costs, prompt_tokens=100, output_tokens=32)
    assert not ctl.prompt_pays([0.9], costs, prompt_tokens=100, output_tokens=16)
    assert ctl.prompt_pays([0.9], costs, prompt_tokens=30, output_tokens=16)  # a shorter prompt: 3 passes
    assert not ctl.prompt_pays([0.1], costs, prompt_tokens=1, output_tokens=1000)  # speculation would not run
    assert ctl.prompt_pays([0.9], CostModel(), prompt_tokens=1, output_tokens=1000)  # nothing measured: read, measure
    assert ctl.prompt_pays([0.9], costs_with(draft=0.1, verify=1.0), 100, 16)  # reading time unknown: read


def test_sequences_whose_prompt_the_draft_read_have_their_own_acceptance():
    """Drafts restarted on a short window agree less than drafts with the whole prompt: their rejections must
    not talk the controller out of reading prompts. A sequence whose prompt is read starts from what such
    sequences measured (0.9 before any), and the decision to read a joining prompt uses it too."""
    ctl = SpeculationController(4, adaptive=True)
    ctl.costs = costs_with(draft=0.2, verify=1.0)
    ctl.costs.record_prefill("draft", 100, 1.0)
    window = ctl.new_estimate()
    assert not window.read_prompt and window.rate == pytest.approx(0.6)
    read = ctl.new_estimate(read_prompt=True)
    assert read.read_prompt and read.rate == pytest.approx(SpeculationController.PROMPT_PRIOR)
    for _ in range(20):  # windowed drafts, rejected at once: the pooled rate falls, the prompt prior stays
        ctl.report(StepReport(1, 4, 0.2, 5, 1.2, [Outcome(window, 4, 0)]))
    assert ctl.acceptance.rate < 0.1 and ctl.with_prompt is None
    assert ctl.draft_reads_prompt([], 1, 100, 64)
    assert ctl.new_estimate(read_prompt=True).rate == pytest.approx(SpeculationController.PROMPT_PRIOR)
    for _ in range(20):  # drafts with their prompt, rejected at once too: now reading does not pay
        ctl.report(StepReport(1, 4, 0.2, 5, 1.2, [Outcome(read, 4, 0)]))
    assert ctl.with_prompt.rate < 0.1 and ctl.new_estimate(read_prompt=True).rate < 0.1
    assert not ctl.draft_reads_prompt([], 1, 100, 64)


def test_a_drafters_first_forward_at_a_batch_size_is_not_taken_as_its_cost():
    """The first draft forward pays one-off costs (a draft model's weights paged in): measured at 0.9 of a
    target pass against 0.45 after, it had kept the adaptive draft model off for good. It is left out, so the
    controller probes once more and decides on the second measure."""
    ctl = SpeculationController(4, adaptive=True)
    est = ctl.new_estimate(read_prompt=True)
    for _ in range(3):
        ctl.report(StepReport(1, 0, None, 1, 1.0, []))  # plain passes: one row costs 1.0
    assert ctl.choose([est], [64], [512]) == [1] and ctl.policy.probing  # nothing measured: probe
    ctl.report(StepReport(1, 1, 0.9, 2, 1.05, [Outcome(est, 1, 1)]))  # the cold first forward
    assert ctl.costs.draft_time(1) is None
    assert ctl.choose([est], [64], [512]) == [1] and ctl.policy.probing  # probe again
    ctl.report(StepReport(1, 1, 0.2, 2, 1.05, [Outcome(est, 1, 1)]))
    assert ctl.costs.draft_time(1) == pytest.approx(0.2)
    assert ctl.choose([est], [64], [512])[0] > 1  # it pays: speculation on


# ------------------------------------------------------------------------------------------- labelled drafts
def test_a_line_fitted_to_every_pass():
    fit = LineFit()
    assert fit.time(2) is None
    fit.add(1, 1.0)
    fit.add(1, 1.0)
    assert fit.time(2) is None  # one width: no slope yet
    fit.add(3, 1.2)
    fit.add(3, 1.2)
    assert fit.time(2) == pytest.approx(1.1) and fit.time(13) == pytest.approx(2.2)
    fit.add(5, 0.5)  # a fast wide pass cannot make the line slope down
    assert fit.time(9) >= fit.time(1)
    costs = CostModel()
    costs.record_verify(1, 1.0)
    assert costs.pass_time(3) == costs.verify_time(3) == 2.0  # one width: the per-width estimate
    costs.record_verify(3, 1.2)
    assert costs.pass_time(13) == pytest.approx(2.2)


def test_kind_rates_count_the_verified_tokens_of_each_kind_and_each_sequences_lean():
    rates = KindRates(3, prior=0.5, weight=1.0, forget=0.5)
    est = AcceptanceEstimate()
    assert est.lean == 1.0 and rates.rate(0) == 0.5
    rates.learn([0, 0, 1, 2], accepted=2, estimate=est)  # 0, 0 accepted, 1 rejected, 2 never verified
    assert rates.tried == [2.0, 1.0, 0.0] and rates.accepted == [2.0, 0.0, 0.0]
    assert rates.rate(0) == pytest.approx(2.5 / 3) and rates.rate(1) == pytest.approx(0.25) and rates.rate(2) == 0.5
    assert est.lean == pytest.approx((2 + 2) / (1.5 + 2))  # 2 accepted where the prior expected 1.5: leans up
    rates.step()
    assert rates.tried == [1.0, 0.5, 0.0] and rates.rate(1) == pytest.approx(0.5 / 1.5)  # back toward the prior
    other = AcceptanceEstimate()
    for _ in range(30):  # kind 0's tokens fail for this sequence and are accepted for another one
        rates.learn([0], 0, est)
        rates.learn([0], 1, other)
    assert 0.4 < rates.rate(0) < 0.6 and est.lean < 0.5 < 1.5 < other.lean


def test_a_sequence_whose_drafts_are_cut_for_its_misses_drafts_again_once_they_are_old():
    """Three early misses make a sequence's lean cut every later draft where a row costs half a pass; steps
    without a verified labelled token relax the lean as learning steps do, so its drafts pay again and are
    tried (before, its drafts stayed cut for the whole request: the lean only moved when a draft was verified)."""
    controller = SpeculationController(24, adaptive=True, guess_kinds=4)
    controller.costs = _pass_costs(0.5)
    controller.policy = _learned({0: 0.8})
    est = controller.new_estimate()
    for _ in range(3):
        controller.report(StepReport(1, 24, None, 2, None, [Outcome(est, 1, 0)], kinds=[LabelledOutcome(est, [0], 0)]))
    assert est.lean < 0.5
    assert controller.cut([Draft([9], kinds=[0])], [est])[0].tokens == []  # 0.8 x lean pays no half-pass row
    steps = 0
    while not controller.cut([Draft([9], kinds=[0])], [est])[0].tokens:
        controller.report(StepReport(1, 24, None, 1, None, [Outcome(est, 0, 0)]))  # a step with nothing drafted
        steps += 1
        assert steps < 40
    assert steps >= 5 and est.lean > 0.6  # not at once: the misses count for some steps (~13)
    other = controller.new_estimate()  # a sequence that learned this step is not relaxed on top of it
    controller.report(StepReport(1, 24, None, 2, None, [Outcome(other, 1, 0)], kinds=[LabelledOutcome(other, [0], 0)]))
    assert other.kind_expected == pytest.approx(controller.policy.rates.rate(0), rel=0.05)


def _pass_costs(per_row: float) -> CostModel:
    costs = CostModel()
    for rows in (1, 2, 5):
        costs.record_verify(rows, 1.0 + per_row * (rows - 1))
    return costs


def _learned(rates_by_kind: dict[int, float], kinds: int = 4) -> ByKind:
    policy = ByKind(24, kinds)
    for kind, rate in rates_by_kind.items():  # 1000 tokens of the kind, `rate` of them accepted
        policy.rates.tried[kind], policy.rates.accepted[kind] = 1000.0, 1000.0 * rate
    return policy


def test_by_kind_cuts_each_draft_where_its_tokens_stop_paying_for_their_rows():
    policy = _learned({0: 0.97, 1: 0.05, 2: 0.3})
    costs = _pass_costs(0.12)
    assert policy.width([[0] * 12], [1.0], costs) == 12  # a sure run: all of it (E = 9.7 for 2.3 passes)
    assert policy.width([[1, 1, 1]], [1.0], costs) == 0  # 5% guesses do not pay 12% a row
    assert policy.width([[0, 0, 0, 1, 0, 0]], [1.0], costs) == 3  # the run up to the unlikely token
    assert policy.width([[2]], [1.0], costs) == 1  # 30% for 12%: pays
    assert policy.width([[2]], [0.3], costs) == 0  # ... not for a sequence whose tokens fare a third as well
    assert policy.width([[2]], [1.0], _pass_costs(0.5)) == 0  # ... nor where a row costs half a pass
    assert policy.width([[0] * 6, [1] * 6], [1.0, 1.0], costs) == 6  # one width for the batch: the sure one's
    assert policy.width([[2, 2], []], [1.0, 1.0], CostModel()) == 2  # nothing measured: all of it, to measure
    assert policy.width([[], []], [1.0, 1.0], costs) == 0


def test_the_controller_cuts_labelled_chains_and_learns_from_their_verdicts():
    controller = SpeculationController(24, adaptive=True, guess_kinds=4)
    assert isinstance(controller.policy, ByKind)
    assert not isinstance(SpeculationController(24, guess_kinds=4).policy, ByKind)  # fixed K: drafts as they are
    controller.costs = _pass_costs(0.12)
    controller.policy = _learned({0: 0.97, 1: 0.05})
    est = controller.new_estimate()
    assert controller.choose([est], [100], [1000]) == [24]  # it drafts what it can; the cut decides
    probs = torch.full((5, 7), 1 / 7)
    drafts = controller.cut([Draft([9, 8, 7, 6, 5], probs, kinds=[0, 0, 1, 1, 0])], [est])
    assert drafts[0].tokens == [9, 8] and drafts[0].kinds == [0, 0] and drafts[0].probs.shape == (2, 7)
    tree = Draft([9, 8], parents=[-1, -1])
    assert controller.cut([tree, Draft([5], kinds=[1])], [est, est])[0] is tree  # trees are not cut
    tried = controller.policy.rates.tried[1]
    controller.report(StepReport(1, 24, None, 3, 1.1, [Outcome(est, 2, 1)], kinds=[LabelledOutcome(est, [0, 1], 1)]))
    assert controller.policy.rates.tried[1] == pytest.approx(tried * 0.995 + 1)
    assert est.kind_accepted == 1


def test_suffix_drafts_are_labelled_by_how_sure_the_trie_is_and_how_much_context_it_matched():
    assert SuffixProposer.kinds_of([1.0, 0.6], 3) == [3 * 5 + 1, 1 * 5 + 2]  # the docstring's example
    assert SuffixProposer.kinds_of([0.4, 0.4, 0.1], 1) == [0, 3 * 5 + 1, 0 * 5 + 1]
    assert SuffixProposer.kinds_of([1.0] * 3, 15) == [3 * 5 + 3, 3 * 5 + 4, 3 * 5 + 4]
    assert SuffixProposer(None).guess_kinds == 20 and SuffixProposer(None, tree=True).guess_kinds == 0


# ------------------------------------------------------------------------------------------- engine, degraded draft
def generate(engine: Engine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adaptive_engine_stops_drafting_with_a_degraded_draft(dtype):
    """Draft = the target with its logits permuted: it almost never agrees. With fixed K every pass drafts;
    the adaptive controller ends up drafting only on its first steps and on probes (every 16 passes), while
    the output stays exactly the plain greedy output."""
    target = varied_model(seed=0, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    plain = generate(Engine(target, FakeTokenizer(), max_model_len=256), prompt, params)

    degraded = PermutedLogitsModel(target, seed=1)
    fixed = generate(Engine(target, FakeTokenizer(), DraftModelProposer(degraded, 1, 256), num_speculative_tokens=4,
                            adaptive=False, max_model_len=256), prompt, params)
    adaptive = generate(Engine(target, FakeTokenizer(), DraftModelProposer(degraded, 1, 256), num_speculative_tokens=4,
                               adaptive=True, max_model_len=256), prompt, params)
    assert fixed.token_ids == plain.token_ids
    assert adaptive.token_ids == plain.token_ids
    assert fixed.metrics.acceptance_rate < 0.1  # the draft is indeed degraded
    assert fixed.metrics.num_drafts >= fixed.metrics.target_passes - 1
    m = adaptive.metrics
    # ~120 passes: a handful of drafts before the estimate drops, then one probe every 16 passes
    assert m.target_passes >= 100
    assert m.num_drafts <= 0.2 * m.target_passes, m.to_dict()
    assert m.num_draft_tokens <= 0.15 * fixed.metrics.num_draft_tokens, m.to_dict()
