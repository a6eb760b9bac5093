"""Auto speculation beside the target's heads (Medusa, EAGLE): the trie's draft or the heads', per sequence and
step, by the value of each (`specdec.speculative.auto`); both label their tokens by kind of guess.

The heads are asked only for the sequences where their best case could beat the trie's draft (`_bound`: a chain
of the kinds accepted most often at each depth): where a copy runs, the step saves the heads' passes and chooses
what it would have chosen anyway.

With `tree` (and one sequence running), where the trie and the heads both have a draft and disagree on its first
token, one pass may carry both as the two branches of a tree (`_tree`): it is expected to accept the trie's
branch as before, plus, when the trie's first token is wrong, the heads' branch; it is verified when that is
worth more per second of its wider pass than the better single draft. The trie's nodes are point masses and the
heads' nodes keep their distribution: siblings drawn independently, as multi-draft rejection sampling needs
(`tree.tree_rejection_sample`), so sampling stays exact too.

Example: where a pass of up to 4 rows costs what one does, a trie draft of 3 tokens of kinds accepted at 0.9 is
worth 1 + 0.9 + 0.81 + 0.73 = 3.44 tokens a pass; heads of K = 3 whose kinds accepted most often at each depth are
at 0.8, 0.6 and 0.5 give at most 1 + 0.8 + 0.48 + 0.24 = 2.52: they are not asked for that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specdec.speculative.auto import AutoProposer, AutoRow, reach_of
from specdec.speculative.proposers import Draft, Proposal, Proposer, SuffixProposer


@dataclass
class _HeadsRow(AutoRow):
    tree: tuple[list[int], list[int]] | None = None  # its last draft's branches' kinds, if a two-drafter tree


class AutoHeadsProposer(AutoProposer):
    """The suffix tries beside `heads` (a chain proposer whose tokens are labelled), `k` the heads' K, `name`
    their drafts' source ("medusa", "eagle"); `tree`: two-drafter trees (see the module's docstring)."""

    def __init__(self, suffix: SuffixProposer, heads: Proposer, k: int, name: str, tree: bool = False) -> None:
        if heads.guess_kinds == 0:
            raise ValueError("auto speculation beside heads needs their chain drafts (not trees)")
        super().__init__(suffix, heads, k, name, heads.guess_kinds)
        self.tree = tree
        self.offset = suffix.guess_kinds  # the heads' kinds follow the trie's

    def _new_row(self, seq) -> _HeadsRow:
        return _HeadsRow(seq)

    def _bound(self, k: int, lean: float) -> float:
        """What no draft of the heads up to k tokens can value more than: the value of a chain whose token
        at each depth is of the kind accepted most often at that depth (every rate at least its draft's)."""
        rates = self.policy.rates.rate
        depth = min(k, self.second.max_depth)  # (the heads draft no deeper)
        return self._value_of([max(rates(self.offset + kind) for kind in self.second.kinds_at(d))
                               for d in range(depth)], lean)

    def _asks(self, ks, rows: list[_HeadsRow], tries: list[Draft], values: list[float]) -> list[int]:
        """The tokens asked of the heads for each sequence: none where their best case cannot beat the trie's
        draft (the choice is the same without asking them there), all where the trie has none or with `tree`."""
        return [min(k, self.k) if self.tree or not tries[b].tokens
                or self._bound(min(k, self.k), rows[b].lean.lean) > values[b] else 0 for b, k in enumerate(ks)]

    def _choose(self, seqs, ks, rows: list[_HeadsRow], tries: list[Draft]) -> Proposal:
        values = self._values(tries, rows)
        asks = self._asks(ks, rows, tries, values)
        heads, forward = [Draft([]) for _ in seqs], None
        if any(asks):
            t0 = self.clock()
            heads = [replace(d, kinds=[self.offset + kind for kind in d.kinds], source=self.second_name)
                     if d.tokens else d for d in self.second.draft(seqs, asks)]
            forward = self.clock() - t0
        drafts = list(tries)
        for b, (d, row) in enumerate(zip(heads, rows)):
            if d.tokens and (self._value(d.kinds, row.lean.lean) > values[b] or not tries[b].tokens):
                drafts[b] = d
        drafts = self._cut(drafts, rows)
        for row in rows:
            row.tree = None
        if self.tree and len(seqs) == 1:  # (in a batch the widest draft widens every row's pass)
            drafts = [self._tree(drafts[0], tries[0], heads[0], rows[0], ks[0])]
        return Proposal(drafts, forward)

    def _reach(self, kinds: list[int], lean: float) -> list[float]:
        """E(w) for w = 1..len(kinds): the expected accepted tokens of the draft cut to w tokens."""
        return reach_of([self.policy.rates.rate(kind) for kind in kinds], lean)

    def _tree(self, chosen: Draft, trie: Draft, heads: Draft, row: _HeadsRow, k: int) -> Draft:
        """The trie's and the heads' drafts as one tree (cut to the widths that pay, `k` nodes at most) where
        that is expected to give more tokens per second than `chosen`, the better of them; else `chosen`."""
        base = self.costs.pass_time(1)
        if not trie.tokens or not heads.tokens or trie.tokens[0] == heads.tokens[0] or base is None:
            return chosen
        lean = row.lean.lean
        single = (1.0 + self._reach(chosen.kinds, lean)[-1]) / self.costs.pass_time(len(chosen.tokens) + 1) \
            if chosen.tokens and chosen.kinds else 1.0 / base
        reach_t, reach_h = self._reach(trie.kinds, lean), self._reach(heads.kinds, lean)
        miss = 1.0 - reach_t[0]  # the heads' branch counts where the trie's first token is wrong
        best, widths = single, None
        for wt in range(1, min(len(reach_t), k - 1) + 1):
            for wh in range(1, min(len(reach_h), k - wt) + 1):
                value = (1.0 + reach_t[wt - 1] + miss * reach_h[wh - 1]) / self.costs.pass_time(wt + wh + 1)
                if value > best:
                    best, widths = value, (wt, wh)
        if widths is None:
            return chosen
        wt, wh = widths
        probs = None
        if heads.probs is not None:  # the trie's nodes as point masses beside the heads' distributions
            points = torch.zeros(wt, heads.probs.shape[-1], dtype=heads.probs.dtype, device=heads.probs.device)
            points[torch.arange(wt), torch.tensor(trie.tokens[:wt])] = 1.0
            probs = torch.cat([points, heads.probs[:wh]])
        row.tree = (trie.kinds[:wt], heads.kinds[:wh])
        return Draft(trie.tokens[:wt] + heads.tokens[:wh], probs=probs,
                     parents=list(range(-1, wt - 1)) + [-1] + list(range(wt, wt + wh - 1)),
                     source=f"suffix+{self.second_name}")

    def _learn(self, row: _HeadsRow, draft: Draft, verdict) -> None:
        if row.tree is None or not draft.tokens:
            super()._learn(row, draft, verdict)
        elif draft.parents is not None:  # a two-drafter tree: each branch learns what it got
            trie_kinds, heads_kinds = row.tree
            path = verdict.kept()
            on_trie = bool(path) and path[0] < len(trie_kinds)
            self.policy.rates.learn(trie_kinds, len(path) if on_trie else 0, row.lean)
            self.policy.rates.learn(heads_kinds, len(path) if path and not on_trie else 0, row.lean)
        elif draft.kinds is not None:
            self.policy.rates.learn(draft.kinds, verdict.num_accepted, row.lean)
