"""Tree drafts: shapes, greedy tree acceptance tables, and tree rejection sampling's exactness.

Distribution check: a depth-2 tree per draw (3 siblings under the root drawn independently from
draft q0, 2 under each of them from q1[parent token]); the target's distribution is p0 at the root and
p1[a] after token a. The first emitted token must follow p0, and the second, among the runs that kept a
first token a, must follow p1[a]. Tolerance as in test_sampling_distribution (`assert_follows`: 5 sigma +
3 draws of slack per token; odds of a false failure below 1e-3 over this file, seeds fixed). N = 4000
draws per case; `test_the_check_catches_a_sampler_that_forgets_the_residual` shows that it has the power
to see a plausible bug.
"""

from __future__ import annotations

import pytest
import torch

from specdec.speculative.head_proposers import default_tree
from specdec.speculative.tree import TreeShape, ancestor_mask, depths, greedy_accept_tree, tree_rejection_sample
from specdec.speculative.acceptance import Verdict
from test_sampling_distribution import assert_follows

N = 4000


def test_tree_shape_from_medusa_choices():
    shape = TreeShape.from_choices([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents == (-1, -1, 0, 0, 1, 2)
    assert shape.ranks == (0, 1, 0, 1, 0, 0)
    assert shape.depth == 3
    assert shape.truncated(2).paths == shape.paths[:5]
    assert TreeShape.chain(3).parents == (-1, 0, 1)
    assert default_tree(2).paths == ((0,), (1,), (0, 0), (0, 1))
    with pytest.raises(ValueError, match="no parent"):
        TreeShape.from_choices([[0], [1, 0]])
    with pytest.raises(ValueError, match="ranks 0..1"):
        TreeShape.from_choices([[0], [2]])


def test_ancestor_mask_and_depths():
    parents = [-1, -1, 0, 2]
    assert depths(parents) == [1, 1, 2, 3]
    mask = ancestor_mask(parents)  # [root, n0, n1, n2, n3]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, True, False, True, True],
    ]


def one_hot_logits(argmax: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


#      tokens           parents           target argmax per row [root, *nodes]     verdict
GREEDY_TREE_CASES = [
    ("first branch all the way + bonus", [5, 6, 7], [-1, -1, 0], [5, 7, 0, 9], Verdict(2, 9, (0, 2))),
    ("second sibling, then its child", [5, 6, 7], [-1, -1, 1], [6, 0, 7, 3], Verdict(2, 3, (1, 2))),
    ("no child matches: recovered", [5, 6, 7], [-1, -1, 0], [8, 0, 0, 0], Verdict(0, 8, ())),
    ("leaf reached: bonus from the leaf's row", [5, 6], [-1, 0], [5, 6, 4], Verdict(2, 4, (0, 1))),
    ("siblings with the same token: the first wins", [5, 5, 7], [-1, -1, 1], [5, 7, 7, 1], Verdict(1, 7, (0,))),
    ("stops below a matching node whose children miss", [5, 6, 7], [-1, 0, 0], [5, 8, 0, 0], Verdict(1, 8, (0,))),
]


@pytest.mark.parametrize("name,tokens,parents,argmax,expected", GREEDY_TREE_CASES, ids=[c[0] for c in GREEDY_TREE_CASES])
def test_greedy_tree_acceptance_table(name, tokens, parents, argmax, expected):
    verdict = greedy_accept_tree(tokens, parents, one_hot_logits(argmax))
    assert verdict == expected
    assert verdict.output_tokens(tokens) == [tokens[i] for i in expected.path] + [expected.next_token]


def norm(x) -> torch.Tensor:
    x = torch.tensor(x, dtype=torch.float64)
    return (x / x.sum()).float()


V = 4
CASES = {  # name: (p0, p1 [V, V], q0, q1 [V, V]) -- p: target, q: draft
    "random": (norm([4, 3, 2, 1]), torch.stack([norm([1, 2, 3, 4]), norm([2, 2, 1, 5]), norm([3, 1, 1, 1]), norm([1, 1, 1, 1])]),
               norm([1, 1, 3, 5]), torch.stack([norm([5, 1, 1, 1]), norm([1, 5, 1, 1]), norm([1, 1, 5, 1]), norm([1, 1, 1, 5])])),
    "draft mass where the target has none": (norm([0, 1, 1, 0]), torch.stack([norm([1, 0, 0, 1])] * V),
                                             norm([1, 1, 1, 1]), torch.stack([norm([0, 1, 1, 0])] * V)),
    "draft zeros where the target has mass": (norm([1, 1, 1, 1]), torch.stack([norm([1, 2, 3, 4])] * V),
                                              norm([0, 0, 1, 0]), torch.stack([norm([1, 0, 0, 0])] * V)),
    "target one-hot": (norm([0, 0, 1, 0]), torch.stack([norm([0, 1, 0, 0])] * V),
                       norm([1, 1, 1, 1]), torch.stack([norm([1, 1, 1, 1])] * V)),
    "draft equals target": (norm([1, 2, 3, 4]), torch.stack([norm([4, 3, 2, 1])] * V),
                            norm([1, 2, 3, 4]), torch.stack([norm([4, 3, 2, 1])] * V)),
}


def run_tree(p0, p1, q0, q1, g, sampler=tree_rejection_sample, point_masses=False):
    """N depth-2 trees; returns (first [N], second [N] or -1 where no first token was kept)."""
    first, second = [], []
    for _ in range(N):
        tokens, parents, dprobs = [], [], []
        for t in torch.multinomial(q0, 3, replacement=True, generator=g).tolist():
            tokens.append(t), parents.append(-1), dprobs.append(q0)
        for i in range(3):
            for u in torch.multinomial(q1[tokens[i]], 2, replacement=True, generator=g).tolist():
                tokens.append(u), parents.append(i), dprobs.append(q1[tokens[i]])
        rows = [p0] + [p1[t] for t in tokens[:3]] + [norm([1] * V)] * 6  # bonus rows below depth 2: any
        verdict = sampler(tokens, parents, None if point_masses else torch.stack(dprobs), torch.stack(rows), g)
        out = verdict.output_tokens(tokens)
        first.append(out[0])
        second.append(out[1] if verdict.num_accepted >= 1 else -1)
    return torch.tensor(first), torch.tensor(second)


def check(first, second, p0, p1, what):
    assert_follows(first, p0, f"{what}: first token")
    kept = second >= 0
    for a in range(V):
        sel = second[kept & (first == a)]
        if len(sel) >= 300:
            assert_follows(sel, p1[a], f"{what}: second token after {a}")


@pytest.mark.parametrize("name", list(CASES))
def test_tree_rejection_sampling_follows_the_target(name):
    p0, p1, q0, q1 = CASES[name]
    g = torch.Generator().manual_seed(list(CASES).index(name))
    first, second = run_tree(p0, p1, q0, q1, g)
    check(first, second, p0, p1, name)
    if name == "draft equals target":  # and it accepts a lot: three siblings, same distribution
        assert (second >= 0).float().mean() > 0.9


def test_tree_rejection_sampling_with_point_mass_siblings():
    """Drafts without probabilities (each sibling a point mass, possibly repeated) stay exact."""
    p0, p1, q0, q1 = CASES["random"]
    g = torch.Generator().manual_seed(3)
    first, second = run_tree(p0, p1, q0, q1, g, point_masses=True)
    check(first, second, p0, p1, "point masses")


def forgets_the_residual(tokens, parents, draft_probs, target_probs, generator):
    """A plausible bug: each sibling is tested against the target itself, not the residual."""
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        for c in kids:
            t = tokens[c]
            if float(torch.rand(1, generator=generator)) * float(draft_probs[c][t]) < float(target_probs[node + 1][t]):
                path.append(c)
                node = c
                break
        else:
            residual = target_probs[node + 1].clone()
            if kids:
                residual = (residual - draft_probs[kids[0]]).clamp(min=0)
            return Verdict(len(path), int(torch.multinomial(residual, 1, generator=generator)), tuple(path))


def test_the_check_catches_a_sampler_that_forgets_the_residual():
    p0, p1, q0, q1 = CASES["random"]
    g = torch.Generator().manual_seed(5)
    first, second = run_tree(p0, p1, q0, q1, g, sampler=forgets_the_residual)
    with pytest.raises(AssertionError):
        check(first, second, p0, p1, "wrong sampler")
