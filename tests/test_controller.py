"""Choosing K: Leviathan's expected-tokens formula, the acceptance estimate, the cost model, fixed and
adaptive K; and, on a tiny model, an adaptive engine with a degraded draft that stops drafting."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, varied_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.speculative.controller import AcceptanceEstimate, AdaptiveK, CostModel, FixedK, expected_tokens
from specdec.speculative.degraded import PermutedLogitsModel
from specdec.speculative.proposers import DraftModelProposer

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


def test_cost_model_smoothing_and_nearest_lookup():
    costs = CostModel(smoothing=0.5)
    assert costs.draft_time(1) is None and costs.verify_time(1) is None
    costs.record_draft(1, 2.0)
    costs.record_draft(1, 4.0)
    assert costs.draft_time(1) == pytest.approx(3.0)
    costs.record_verify(1, 10.0)
    costs.record_verify(6, 12.0)
    assert costs.verify_time(1) == 10.0 and costs.verify_time(6) == 12.0
    assert costs.verify_time(5) == 12.0 and costs.verify_time(2) == 10.0  # nearest measured row count
    assert costs.draft_time(4) == pytest.approx(3.0)


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
    """No costs yet: a cheap probe (K = 1, marked as a probe so a draft model catches up on a short window)
    rather than K_max, which would cost a full draft of a possibly useless draft; once a draft step and a
    2-row pass are measured, a good draft gets the longest K (3-row+ passes not measured yet: the nearest)."""
    est = AcceptanceEstimate()
    assert AdaptiveK(5).choose([est], CostModel()) == [1] and est.probing
    costs = CostModel()
    costs.record_draft(1, 0.05)
    costs.record_verify(1, 1.0)
    costs.record_verify(2, 1.0)
    est = AcceptanceEstimate.with_prior(0.9)
    assert AdaptiveK(5).choose([est], costs) == [5] and not est.probing


def test_adaptive_turns_off_when_acceptance_is_near_zero_and_drafting_costs():
    # a draft forward costs half a target pass; acceptance ~0: every K > 0 loses to plain decoding
    costs = costs_with(draft=0.5, verify=1.0)
    for a in (0.0, 0.02, 0.1):
        assert AdaptiveK(8).best_k(a, 1, costs) == 0


def test_adaptive_takes_k_max_when_acceptance_is_high_and_drafting_cheap():
    costs = costs_with(draft=0.01, verify=1.0)
    for a in (0.95, 0.99, 1.0):
        assert AdaptiveK(8).best_k(a, 1, costs) == 8


def test_adaptive_picks_the_rate_maximising_k():
    # a = 0.8, draft 0.1 of a pass, verification cost flat in rows: E(K) / (1 + 0.1 K) peaks at K = 6
    costs = costs_with(draft=0.1, verify=1.0)
    rates = {k: expected_tokens(0.8, k) / (1 + 0.1 * k) for k in range(1, 9)}
    assert max(rates, key=rates.get) == 6
    assert AdaptiveK(8).best_k(0.8, 1, costs) == 6
    assert AdaptiveK(4).best_k(0.8, 1, costs) == 4  # capped by K_max
    # verification that grows with rows shortens the best K: t_verify(r) = 1 + 0.2 (r - 1)
    costs = costs_with(draft=0.1, verify={r: 1 + 0.2 * (r - 1) for r in range(1, 10)})
    rates = {k: expected_tokens(0.8, k) / (0.1 * k + 1 + 0.2 * k) for k in range(1, 9)}
    assert AdaptiveK(8).best_k(0.8, 1, costs) == max(rates, key=rates.get) == 3


def test_adaptive_uses_the_batch_size_costs():
    # at batch size 1 drafting is cheap, at batch size 2 the draft forward costs as much as a pass
    costs = costs_with(draft=0.01, verify=1.0, batch_size=1)
    costs.record_draft(2, 1.0)
    ctl = AdaptiveK(4)
    assert ctl.best_k(0.7, 1, costs) == 4
    assert ctl.best_k(0.7, 2, costs) == 0


def test_adaptive_probes_while_off_with_a_doubling_interval():
    ctl = AdaptiveK(6, probe_interval=5, max_probe_interval=20)
    costs = costs_with(draft=0.5, verify=1.0)
    est = AcceptanceEstimate(accepted=0.0, rejections=10.0)
    ks = [ctl.choose([est], costs)[0] for _ in range(75)]
    probes = [i + 1 for i, k in enumerate(ks) if k]
    assert set(ks) == {0, 1}
    assert probes == [5, 15, 35, 55, 75]  # after 5, 10, 20, then at most 20 steps
    # a probe that is accepted raises the estimate; once drafting wins again the controller speculates
    cheap = costs_with(draft=0.01, verify=1.0)
    est = AcceptanceEstimate(accepted=0.0, rejections=10.0)
    assert ctl.choose([est], cheap) == [0]
    for _ in range(10):
        est.update(num_drafted=1, num_accepted=1, decay=ctl.decay)
    assert ctl.choose([est], cheap)[0] > 0 and est.steps_off == 0


def test_adaptive_chooses_per_sequence():
    ctl = AdaptiveK(5, probe_interval=100)
    costs = costs_with(draft=0.05, verify=1.0, batch_size=2)
    good, bad = AcceptanceEstimate(accepted=99.0, rejections=1.0), AcceptanceEstimate(accepted=0.0, rejections=9.0)
    assert ctl.choose([good, bad], costs) == [5, 0]


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
    fixed = generate(Engine(target, FakeTokenizer(), DraftModelProposer(degraded, 1, 256), 4, adaptive=False,
                            max_model_len=256), prompt, params)
    adaptive = generate(Engine(target, FakeTokenizer(), DraftModelProposer(degraded, 1, 256), 4, adaptive=True,
                               max_model_len=256), prompt, params)
    assert fixed.token_ids == plain.token_ids
    assert adaptive.token_ids == plain.token_ids
    assert fixed.metrics.acceptance_rate < 0.1  # the draft is indeed degraded
    assert fixed.metrics.num_drafts >= fixed.metrics.target_passes - 1
    m = adaptive.metrics
    # ~120 passes: a handful of drafts before the estimate drops, then one probe every 16 passes
    assert m.target_passes >= 100
    assert m.num_drafts <= 0.2 * m.target_passes, m.to_dict()
    assert m.num_draft_tokens <= 0.15 * fixed.metrics.num_draft_tokens, m.to_dict()
