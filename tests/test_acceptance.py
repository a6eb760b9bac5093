"""Acceptance tables: hand-written drafts and target distributions whose verdict is certain.

Greedy: the target's argmax decides. Rejection sampling: one-hot / zero probabilities make every
acceptance test and every recovered or bonus draw certain, so the expected verdict is exact for any
generator seed (each case is run under several seeds).
"""

from __future__ import annotations

import pytest
import torch

from specdec.speculative.acceptance import Verdict, greedy_accept, rejection_sample

V = 10
SEEDS = range(8)


def logits_with_argmax(argmax: list[int], vocab: int = V) -> torch.Tensor:
    """Logits [len(argmax), vocab] (random below a clear maximum) whose row i peaks at argmax[i]."""
    g = torch.Generator().manual_seed(len(argmax) * 1000 + sum(argmax))
    logits = torch.randn(len(argmax), vocab, generator=g)
    logits[torch.arange(len(argmax)), argmax] = 10.0
    return logits


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """Point-mass distributions [len(tokens), vocab]."""
    probs = torch.zeros(len(tokens), vocab)
    probs[torch.arange(len(tokens)), tokens] = 1.0
    return probs


# ------------------------------------------------------------------------------------------- greedy
GREEDY_TABLE = [
    # (name, draft, target argmax per row (K + 1 rows), expected verdict, expected output tokens)
    ("all accepted + bonus", [5, 7, 9], [5, 7, 9, 4], Verdict(3, 4), [5, 7, 9, 4]),
    ("first rejected", [5, 7, 9], [6, 7, 9, 4], Verdict(0, 6), [6]),
    ("middle rejected", [5, 7, 9], [5, 8, 9, 4], Verdict(1, 8), [5, 8]),
    ("last rejected", [5, 7, 9], [5, 7, 1, 4], Verdict(2, 1), [5, 7, 1]),
    ("later rows ignored after a rejection", [5, 7, 9], [5, 0, 7, 9], Verdict(1, 0), [5, 0]),
    ("single token accepted", [3], [3, 3], Verdict(1, 3), [3, 3]),
    ("single token rejected", [3], [2, 3], Verdict(0, 2), [2]),
    ("repeated tokens", [1, 1, 1, 1], [1, 1, 1, 2, 0], Verdict(3, 2), [1, 1, 1, 2]),
    ("empty draft: plain decoding", [], [6], Verdict(0, 6), [6]),
]


@pytest.mark.parametrize("name,draft,argmax,verdict,output", GREEDY_TABLE, ids=[c[0] for c in GREEDY_TABLE])
def test_greedy_table(name, draft, argmax, verdict, output):
    got = greedy_accept(draft, logits_with_argmax(argmax))
    assert got == verdict
    assert got.output_tokens(draft) == output


def test_greedy_is_exact_argmax_with_ties_and_tiny_margins():
    # a tie goes to the lowest id (torch.argmax), as in plain decoding through the same function
    logits = torch.zeros(2, V)
    logits[0, 2] = logits[0, 5] = 1.0
    logits[1, 0] = 1.0
    assert greedy_accept([5], logits) == Verdict(0, 2)
    assert greedy_accept([2], logits) == Verdict(1, 0)
    # a margin of one ulp decides: greedy is an argmax, not a tolerance
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 7] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert greedy_accept([], logits) == Verdict(0, 7)
    assert greedy_accept([4], torch.cat([logits, logits])) == Verdict(0, 7)


def test_greedy_output_equals_plain_argmax_chain():
    """The output of a verdict is always the target's own argmax at every emitted position."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=g))
        logits = torch.randn(k + 1, 5, generator=g)
        argmax = logits.argmax(-1).tolist()
        # drafts that agree with the target for a random prefix, then (maybe) disagree
        agree = int(torch.randint(0, k + 1, (1,), generator=g))
        draft = argmax[:agree] + [(t + 1) % 5 for t in argmax[agree:k]]
        verdict = greedy_accept(draft, logits)
        assert verdict.num_accepted == agree
        out = verdict.output_tokens(draft)
        assert out == argmax[: len(out)]
        assert len(out) == agree + 1


# ------------------------------------------------------------------------------------------- rejection sampling
def case(draft, draft_probs, target_probs, verdict, name):
    return pytest.param(draft, draft_probs, target_probs, verdict, id=name)


REJECTION_TABLE = [
    case([3, 4], None, one_hot([3, 4, 8]), Verdict(2, 8),
         "point-mass draft, target one-hot on every drafted token: all accepted, bonus forced"),
    case([3, 4], None, one_hot([1, 4, 8]), Verdict(0, 1),
         "point-mass draft, target 0 on the first drafted token: rejected, recovered forced"),
    case([3, 4, 5], None, one_hot([3, 4, 2, 0]), Verdict(2, 2),
         "point-mass draft, last rejected"),
    case([3, 4, 5], None, one_hot([3, 6, 5, 0]), Verdict(1, 6),
         "point-mass draft, middle rejected (later rows ignored)"),
    case([3, 4], one_hot([3, 4]), one_hot([3, 4, 8]), Verdict(2, 8),
         "one-hot draft_probs equal to target: all accepted"),
    case([3, 4], one_hot([3, 4]), one_hot([3, 9, 8]), Verdict(1, 9),
         "one-hot draft_probs, target 0 on the second drafted token"),
    case([], None, one_hot([6]), Verdict(0, 6),
         "empty draft: plain sampling from the target"),
    case([], torch.zeros(0, V), one_hot([6]), Verdict(0, 6),
         "empty draft with an empty [0, V] draft_probs"),
]


@pytest.mark.parametrize("draft,draft_probs,target_probs,verdict", REJECTION_TABLE)
@pytest.mark.parametrize("seed", SEEDS)
def test_rejection_table(draft, draft_probs, target_probs, verdict, seed):
    got = rejection_sample(draft, draft_probs, target_probs, torch.Generator().manual_seed(seed))
    assert got == verdict


def test_rejection_residual_forces_the_recovered_token():
    """Target 0 on the drafted token -> rejected; normalize(max(0, target - draft)) is nonzero only at 7,
    where the target has more mass than the draft -> recovered 7, whatever the seed."""
    draft_probs = torch.tensor([[0.0, 0.5, 0.3, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0]])
    target_probs = torch.tensor([
        [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0],  # residual: 0 everywhere but 7 (0.3)
        [0.1] * 10,
    ])
    for seed in SEEDS:
        assert rejection_sample([2], draft_probs, target_probs, torch.Generator().manual_seed(seed)) == Verdict(0, 7)


def test_rejection_accepts_where_target_dominates():
    """target_probs[t] >= draft_probs[t] -> min(1, target/draft) = 1: always accepted."""
    draft_probs = torch.full((3, V), 1.0 / V)
    target_probs = torch.full((4, V), 0.5 / (V - 1))
    drafted = [2, 5, 2]
    for i, t in enumerate(drafted):
        target_probs[i, t] = 0.5  # 0.5 >= 0.1: certain acceptance
    target_probs[3] = one_hot([9])[0]
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        assert rejection_sample(drafted, draft_probs, target_probs, g) == Verdict(3, 9)


def test_rejection_draft_equal_to_target_always_accepts():
    """draft_probs == target_probs: the ratio is 1 for every drafted token, so nothing is ever rejected."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, V, generator=g), dim=-1)
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        drafted = torch.multinomial(probs[:3], 1, generator=gen)[:, 0].tolist()
        verdict = rejection_sample(drafted, probs[:3], probs, gen)
        assert verdict.num_accepted == 3


def test_rejection_never_recovers_the_rejected_point_mass_token():
    """Point-mass draft rejected -> the recovered token is drawn from target with the drafted token removed."""
    target_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    seen = set()
    for seed in range(200):
        verdict = rejection_sample([0], None, target_probs, torch.Generator().manual_seed(seed))
        if verdict.num_accepted == 0:
            seen.add(verdict.next_token)
    assert seen == {1}


def test_rejection_same_seed_same_verdict():
    g = torch.Generator().manual_seed(1)
    target_probs = torch.softmax(torch.randn(4, V, generator=g), dim=-1)
    draft_probs = torch.softmax(torch.randn(3, V, generator=g), dim=-1)
    runs = [
        [rejection_sample([1, 2, 3], draft_probs, target_probs, gen) for _ in range(20)]
        for gen in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert runs[0] == runs[1]
