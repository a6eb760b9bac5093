"""Tree drafts: shapes, masks, and lossless acceptance of a tree.

A tree draft is a list of drafted tokens with `parents[i]`, the index of node i's parent among them
(-1: the root, i.e. the sequence's last token). Parents come before children. A chain is the tree
`parents = [-1, 0, 1, ...]`. The target verifies `[last, *tokens]` in one pass where node i attends the
committed prefix, the root, its ancestors and itself, at position `start + depth(i)`.

Static shapes are written as Medusa writes them, a list of paths of child ranks: `[[0], [1], [0, 0]]`
is two children of the root (ranks 0 and 1) and one child under the first. A child of rank r is the
r-th most likely token of its parent's draft distribution when greedy, and the r-th independent draw
from it when sampling (so that tree rejection sampling stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence as Seq

import torch

from specdec.speculative.acceptance import Verdict


@dataclass(frozen=True)
class TreeShape:
    """A static tree from Medusa-style choices, nodes ordered by depth then path."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]  # rank of each node among its siblings

    @classmethod
    def from_choices(cls, choices: list[list[int]]) -> "TreeShape":
        paths = sorted({tuple(c) for c in choices}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 for p in paths):
            raise ValueError("a tree needs at least one node, and every path at least one rank")
        index = {p: i for i, p in enumerate(paths)}
        parents = []
        for p in paths:
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree")
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        for p in paths:  # ranks 0..n-1 under each parent, so that ranks name draws or top-k entries
            siblings = sorted(q[-1] for q in paths if q[:-1] == p[:-1])
            if siblings != list(range(len(siblings))):
                raise ValueError(f"children of {list(p[:-1])} must have ranks 0..{len(siblings) - 1}, got {siblings}")
        return cls(tuple(paths), tuple(parents), tuple(p[-1] for p in paths))

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        return cls.from_choices([[0] * d for d in range(1, depth + 1)])

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, depth: int) -> "TreeShape | None":
        """The nodes at depth <= `depth` (None if depth is 0); built once per shape and depth."""
        return _truncated(self, depth)


@lru_cache(maxsize=256)
def _truncated(shape: TreeShape, depth: int) -> TreeShape | None:
    if depth <= 0:
        return None
    if depth >= shape.depth:
        return shape
    return TreeShape.from_choices([list(p) for p in shape.paths if len(p) <= depth])


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree (Li et al. 2024): at each depth the `beam` nodes with the highest path
    score (sum of the draft's log-probabilities) are expanded with `top_k` children each. Every drawn
    child stays in the tree (pruning drawn siblings would bias tree rejection sampling)."""

    top_k: int = 2
    beam: int = 2

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.beam < 1:
            raise ValueError("a dynamic tree needs top_k >= 1 and beam >= 1")

    def max_nodes(self, depth: int) -> int:
        """The most nodes a tree `depth` deep holds (none for depth 0). Example: top_k 2, beam 2, depth 3 ->
        2 + 4 + 4 = 10."""
        return self.top_k + (depth - 1) * self.beam * self.top_k if depth > 0 else 0


def depths(parents: Seq[int]) -> list[int]:
    """Depth of each node, 1 for children of the root."""
    return list(_depths(tuple(parents)))


@lru_cache(maxsize=1024)
def _depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return tuple(out)


def ancestor_mask(parents: Seq[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool for `[root, *nodes]`: row i may attend column j iff j is i or an ancestor.
    Built once per tree shape: the tensor is shared, read it only."""
    return _ancestor_mask(tuple(parents))


@lru_cache(maxsize=1024)
def _ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def children_of(parents: list[int], node: int) -> list[int]:
    return [i for i, p in enumerate(parents) if p == node]


def greedy_accept_tree(tokens: list[int], parents: list[int], target_logits: torch.Tensor) -> Verdict:
    """Follow the target's argmax down the tree; the first node whose children miss it ends the path.

    target_logits: [N + 1, V], row 0 for the root, row i + 1 for node i.
    Example: tokens [5, 6, 7], parents [-1, -1, 1]; argmax root -> 6 (node 1), node 1 -> 7 (node 2),
    node 2 -> 9: path (1, 2), bonus 9; output [6, 7, 9].
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()
    path: list[int] = []
    node = -1
    while True:
        want = target_tokens[node + 1]
        match = next((c for c in children_of(parents, node) if tokens[c] == want), None)
        if match is None:
            return Verdict(len(path), want, tuple(path))
        path.append(match)
        node = match


def tree_rejection_sample(
    tokens: list[int],
    parents: list[int],
    draft_probs: torch.Tensor | None,  # [N, V] the distribution node i was drawn from (its parent's); None: point masses
    target_probs: torch.Tensor,  # [N + 1, V] processed target distributions, row 0 for the root
    generator: torch.Generator,
) -> Verdict:
    """Multi-draft speculative sampling (SpecInfer, Miao et al. 2024) down the tree: lossless when the
    children of a node are independent draws from its draft distribution.

    At a node with target distribution target_probs[node], its children are tried in turn: child c is
    accepted with probability min(1, residual[c] / draft[c]); after each rejection the residual
    becomes normalize(max(0, residual - draft)). An accepted child becomes the node; when all children
    are rejected (or there are none) the recovered (bonus) token is drawn from the residual.

    Example: target [0.5, 0.5], two children both drew token 0 from draft [1, 0]: the first is kept
    with probability 0.5; if rejected, the residual is [0, 1], so the second (token 0) is rejected too
    and token 1 is recovered.
    """
    path: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].clone()
        for c in children_of(parents, node):
            t = tokens[c]
            draft = draft_probs[c] if draft_probs is not None else None
            draft_t = float(draft[t]) if draft is not None else 1.0
            u = float(torch.rand(1, generator=generator))
            if u * draft_t < float(residual[t]):
                path.append(c)
                node = c
                break
            if draft is not None:
                new = (residual - draft).clamp_(min=0)
            else:
                new = residual.clone()
                new[t] = 0
            if new.sum() > 0:  # else (by rounding only) residual == draft: keep it
                residual = new / new.sum()
        else:
            return Verdict(len(path), int(torch.multinomial(residual, 1, generator=generator)), tuple(path))
