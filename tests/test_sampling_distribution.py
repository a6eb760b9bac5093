"""Speculative sampling is lossless: emitted tokens follow the target's distribution, for any draft.

Each case draws N drafts from the draft distribution (or uses a fixed point-mass draft, as n-gram does),
runs `rejection_sample` once per draft with one seeded generator, and checks, for every position j, the
distribution of the j-th emitted token among the runs whose first j drafted tokens were accepted (j = 0:
the first emitted token; j = K: the bonus token). In these tables the draft and target rows do not depend
on earlier tokens, so that conditional distribution must be exactly target_probs[j].

Tolerance (`assert_follows`): for every token, |empirical - p| <= Z * sqrt(p (1 - p) / n) + SLACK / n,
Z = 5, SLACK = 3 draws (0 when p is exactly 0 or 1: a token the target excludes must never appear, a
certain one must always). For a correct sampler one comparison fails with probability about 6e-7 (normal
tail at 5 sigma; the slack covers the Poisson tail of rare tokens); the file makes about 400 comparisons,
so a false failure has odds below 1e-3 for a random seed, and the seeds here are fixed. N = 6000 draws per
case (n >= 1000 for the conditional positions checked): enough that each wrong sampler in `MUTATIONS`
(recovered token from the target instead of the residual, acceptance that ignores draft_probs, an
inverse-CDF draw from the unnormalized residual, the bonus drawn from the wrong row) fails the same check
by a wide margin (`test_check_detects_wrong_samplers`), and the whole file stays well under 30 s.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sampling import make_generator, process_logits, sample
from specdec.speculative.acceptance import rejection_sample

Z = 5.0
SLACK = 3.0
N = 6000
MIN_CONDITIONAL = 1000  # conditional positions with fewer runs are not checked


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """tokens: [n] emitted ids; probs: [V] the distribution they must follow."""
    n, V = len(tokens), probs.shape[-1]
    emp = torch.bincount(tokens, minlength=V).double() / n
    p = probs.double()
    certain = (p == 0) | (p == 1)
    tol = Z * torch.sqrt(p * (1 - p) / n) + torch.where(certain, 0.0, SLACK / n)
    bad = ((emp - p).abs() > tol).nonzero().flatten().tolist()
    assert not bad, (
        f"{what}: n={n}, tokens {bad} off: empirical {[round(float(emp[i]), 4) for i in bad]} vs target "
        f"{[round(float(p[i]), 4) for i in bad]} (tolerance {[round(float(tol[i]), 4) for i in bad]})"
    )


def draw_drafts(draft_probs, fixed_draft, n, g) -> torch.Tensor:
    """[n, K] drafted tokens: sampled from draft_probs [K, V], or the fixed point-mass draft."""
    if fixed_draft is not None:
        return torch.tensor([fixed_draft] * n, dtype=torch.long)
    return torch.multinomial(draft_probs, n, replacement=True, generator=g).T


def run_real(drafts, draft_probs, target_probs, g):
    """The code under test, once per draft: (num_accepted [n], next_token [n])."""
    verdicts = [rejection_sample(d, draft_probs, target_probs, g) for d in drafts.tolist()]
    return (torch.tensor([v.num_accepted for v in verdicts]), torch.tensor([v.next_token for v in verdicts]))


def emitted_at(j, drafts, num_accepted, next_token) -> torch.Tensor:
    """The j-th emitted token of every run that emitted one (its first j drafted tokens were accepted)."""
    keep = num_accepted >= j
    if j < drafts.shape[1]:
        tok = torch.where(num_accepted > j, drafts[:, j], next_token)
    else:
        tok = next_token
    return tok[keep]


def assert_lossless(drafts, num_accepted, next_token, target_probs, what) -> int:
    """Checks every position with enough runs; returns how many positions were checked."""
    K = drafts.shape[1]
    checked = 0
    for j in range(K + 1):
        tokens = emitted_at(j, drafts, num_accepted, next_token)
        if j == 0 or len(tokens) >= MIN_CONDITIONAL:
            assert_follows(tokens, target_probs[j], f"{what}, emitted token {j}")
            checked += 1
    return checked


# ------------------------------------------------------------------------------------------- cases
def softmax_rows(seed: int, rows: int, vocab: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(rows, vocab, generator=g), dim=-1)


def normalized(x) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=torch.float32)
    return x / x.sum(dim=-1, keepdim=True)


def _cases():
    cases = {}
    # random draft and target
    cases["random V=8 K=2"] = (softmax_rows(1, 2, 8), None, softmax_rows(2, 3, 8))
    # the draft puts most of its mass where the target has none
    target = softmax_rows(3, 3, 8)
    target[:, :3] = 0
    draft = torch.tensor([[0.3, 0.3, 0.2, 0.04, 0.04, 0.04, 0.04, 0.04]] * 2)
    cases["draft mass where target has none"] = (draft, None, normalized(target))
    # target one-hot at every position (the emitted tokens are certain)
    # (the draft puts half its mass on the target's token, so later positions are reached too)
    cases["target one-hot"] = (0.5 * softmax_rows(4, 2, 8) + 0.5 * torch.eye(8)[[5, 0]], None, torch.eye(8)[[5, 0, 3]])
    # draft equal to the target: every drafted token is accepted
    target = softmax_rows(5, 3, 8)
    cases["draft equals target"] = (target[:2].clone(), None, target)
    # draft with zeros where the target has mass: those tokens come only from the residual
    draft = softmax_rows(6, 2, 8)
    draft[:, 4:] = 0
    cases["draft with zeros"] = (normalized(draft), None, softmax_rows(7, 3, 8, scale=0.5))
    # tiny vocabularies
    cases["vocab 2 K=3"] = (
        normalized([[0.6, 0.4], [0.5, 0.5], [0.1, 0.9]]), None,
        normalized([[0.3, 0.7], [0.9, 0.1], [0.5, 0.5], [0.2, 0.8]]),
    )
    cases["vocab 3 K=2"] = (
        normalized([[0.7, 0.2, 0.1], [0.0, 0.5, 0.5]]), None,
        normalized([[0.2, 0.3, 0.5], [0.6, 0.4, 0.0], [0.1, 0.1, 0.8]]),
    )
    # point-mass drafts (n-gram: no probabilities), the drafted token likely, and excluded, by the target
    target = softmax_rows(8, 3, 8)
    target[0, 2] = 0
    likes = softmax_rows(8, 3, 8)
    cases["point mass, target likes the drafted tokens"] = (None, likes[:2].argmax(-1).tolist(), likes)
    cases["point mass, target excludes the first drafted token"] = (None, [2, 5], normalized(target))
    # the same point masses given as explicit one-hot draft_probs
    target = softmax_rows(9, 3, 8)
    cases["one-hot draft_probs"] = (torch.eye(8)[[int(target[0].argmax()), 6]], None, target)
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_tokens_follow_target(name):
    draft_probs, fixed_draft, target_probs = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    drafts = draw_drafts(draft_probs, fixed_draft, N, g)
    num_accepted, next_token = run_real(drafts, draft_probs, target_probs, g)
    checked = assert_lossless(drafts, num_accepted, next_token, target_probs, name)
    assert checked >= (1 if name == "point mass, target excludes the first drafted token" else 2)
    if name == "draft equals target":
        assert bool((num_accepted == drafts.shape[1]).all())
    if name == "point mass, target excludes the first drafted token":
        assert bool((num_accepted == 0).all())


def test_through_process_logits_with_top_k_and_top_p():
    """Temperature, top-k and top-p applied to draft and target logits alike (as the engine does):
    the emitted tokens follow the processed target distribution; tokens cut by top-k/top-p never appear."""
    g = torch.Generator().manual_seed(11)
    V, K = 12, 2
    target_logits = 2.0 * torch.randn(K + 1, V, generator=g)  # [K + 1, V]
    draft_logits = target_logits[:K] + 1.5 * torch.randn(K, V, generator=g)  # [K, V], a related but worse draft
    for params in (
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.8),
    ):
        draft_probs, target_probs = process_logits(draft_logits, params), process_logits(target_logits, params)
        assert bool(((target_probs > 0).sum(-1) < V).all())  # the filters did cut something
        gen = make_generator(1234)
        drafts = torch.stack([torch.tensor([sample(draft_probs[i], gen) for i in range(K)]) for _ in range(N // 3)])
        num_accepted, next_token = run_real(drafts, draft_probs, target_probs, gen)
        assert_lossless(drafts, num_accepted, next_token, target_probs, f"{params}")


# ------------------------------------------------------------------------------------------- convergence
def test_error_shrinks_with_samples():
    """As in vLLM's test: the distance between the empirical first-token distribution and the target
    shrinks like 1/sqrt(n), while a wrong sampler (recovered token drawn from the target instead of the
    residual) stays at its bias.

    16000 draws are cut into disjoint blocks of n = 1000, 4000 and 16000; err(n) is the root mean square,
    over the blocks, of the L2 distance to target_probs[0]. Expected for a correct sampler:
    sqrt((1 - sum p^2) / n), halving at each 4x step. Asserted: err(4000) < 0.75 err(1000),
    err(16000) < err(4000), err(16000) < 2.5x the expected noise. In 10000 simulated runs of a correct
    sampler on this case none failed (the largest err(16000) was 2.0x the expected noise); the wrong sampler
    sits at over 14x the noise at 16000 draws and its error does not shrink (ratio to n = 1000 above 0.95).
    """
    V = 16
    draft_probs, target_probs = softmax_rows(21, 1, V, scale=2.0), softmax_rows(22, 2, V, scale=0.5)
    g = torch.Generator().manual_seed(3)
    drafts = draw_drafts(draft_probs, None, 16000, g)
    num_accepted, next_token = run_real(drafts, draft_probs, target_probs, g)
    first = emitted_at(0, drafts, num_accepted, next_token)
    mutant = vectorized_sampler(drafts, draft_probs, target_probs, g, "recover_from_target")
    mutant_first = emitted_at(0, drafts, *mutant)
    p = target_probs[0].double()

    def err(tokens, n):
        blocks = tokens.view(-1, n)
        dist = [float((torch.bincount(b, minlength=V).double() / n - p).norm()) for b in blocks]
        return math.sqrt(sum(d * d for d in dist) / len(dist))

    errors = {n: err(first, n) for n in (1000, 4000, 16000)}
    mutant_errors = {n: err(mutant_first, n) for n in (1000, 4000, 16000)}
    noise = math.sqrt((1 - float((p ** 2).sum())) / 16000)
    assert errors[4000] < 0.75 * errors[1000] and errors[16000] < errors[4000], errors
    assert errors[16000] < 2.5 * noise, (errors, noise)
    assert mutant_errors[16000] > 5 * noise and mutant_errors[16000] > 0.8 * mutant_errors[1000], mutant_errors


# ------------------------------------------------------------------------------------------- power of the check
MUTATIONS = ("recover_from_target", "accept_by_target", "unnormalized_residual", "bonus_off_by_one")


def vectorized_sampler(drafts, draft_probs, target_probs, g, mutation=None):
    """Rejection sampling for n runs at once ([n, K] drafts), correct or with one deliberate bug."""
    n, K = drafts.shape
    V = target_probs.shape[-1]
    rows = torch.arange(K)
    target_p = target_probs[rows, drafts]  # [n, K]
    draft_p = draft_probs[rows, drafts] if draft_probs is not None else torch.ones(n, K)
    u = torch.rand(n, K, generator=g)
    accepted = u < target_p if mutation == "accept_by_target" else u * draft_p < target_p
    rejected = ~accepted.all(dim=1)
    num_accepted = torch.where(rejected, (~accepted).int().argmax(dim=1), K)
    at = num_accepted.clamp(max=K - 1)
    if draft_probs is not None:
        residual = (target_probs[at] - draft_probs[at]).clamp(min=0)
    else:
        residual = target_probs[at].clone()
        residual[torch.arange(n), drafts[torch.arange(n), at]] = 0
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[at])
    if mutation == "recover_from_target":
        residual = target_probs[at]
    bonus = target_probs[K - 1 if mutation == "bonus_off_by_one" else K].expand(n, V)
    dist = torch.where(rejected[:, None], residual, bonus)
    if mutation == "unnormalized_residual":  # inverse CDF of the raw residual: the missing mass falls on V - 1
        cdf = torch.cumsum(dist, dim=-1)
        next_token = (cdf <= torch.rand(n, 1, generator=g)).sum(-1).clamp(max=V - 1)
        next_token = torch.where(rejected, next_token, torch.multinomial(dist, 1, generator=g)[:, 0])
    else:
        next_token = torch.multinomial(dist, 1, generator=g)[:, 0]
    return num_accepted, next_token


POWER_CASE = (softmax_rows(31, 1, 6), softmax_rows(32, 2, 6))  # K = 1, V = 6


@pytest.mark.parametrize("mutation", (None, *MUTATIONS))
def test_check_detects_wrong_samplers(mutation):
    """The same check, same N, on a vectorized copy of the algorithm: the correct copy passes, and each
    deliberately wrong one fails (on the random K = 1 case: first emitted token, and the bonus)."""
    draft_probs, target_probs = POWER_CASE
    g = torch.Generator().manual_seed(99)
    drafts = draw_drafts(draft_probs, None, N, g)
    num_accepted, next_token = vectorized_sampler(drafts, draft_probs, target_probs, g, mutation)
    if mutation is None:
        assert_lossless(drafts, num_accepted, next_token, target_probs, "correct")
    else:
        with pytest.raises(AssertionError):
            assert_lossless(drafts, num_accepted, next_token, target_probs, mutation)


def test_vectorized_reference_agrees_with_real_on_certain_cases():
    """The vectorized copy used above is itself the algorithm: on one-hot targets it gives the real verdicts."""
    target_probs = torch.eye(6)[[2, 4, 1]]
    draft_probs = softmax_rows(41, 2, 6)
    g = torch.Generator().manual_seed(0)
    drafts = draw_drafts(draft_probs, None, 200, g)
    expected = run_real(drafts, draft_probs, target_probs, g)
    got = vectorized_sampler(drafts, draft_probs, target_probs, g)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ------------------------------------------------------------------------------------------- process_logits
def test_process_logits_examples():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([[math.e / (math.e + 1), 1 / (math.e + 1), 0.0]]))
    assert probs[0, 2] == 0
    # temperature 0.5 doubles the logits
    assert torch.allclose(process_logits(logits, SamplingParams(temperature=0.5)), torch.softmax(2 * logits, -1))
    # top_p keeps the smallest most-likely set whose mass reaches top_p, the crossing token included
    probs = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(top_p=0.7))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # 0.5 + 0.3 reaches 0.8
    probs = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(top_p=0.81))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    probs = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(top_p=5e-324))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # a top_p below float32's range: the top token
    # top-k then top-p; rows are independent
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
    probs = process_logits(logits, SamplingParams(top_k=3, top_p=0.5))
    assert torch.allclose(probs, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7], [4 / 7, 3 / 7, 0.0, 0.0]]))
    assert probs.dtype == torch.float32


def test_seeded_draws_are_reproducible():
    probs = torch.softmax(torch.randn(50), -1)
    a = [sample(probs, g) for g in [make_generator(7)] for _ in range(30)]
    b = [sample(probs, g) for g in [make_generator(7)] for _ in range(30)]
    c = [sample(probs, g) for g in [make_generator(8)] for _ in range(30)]
    assert a == b and a != c
