"""Auto speculation: for each sequence and step, the drafter expected to give the most tokens per second.

Suffix decoding costs nothing to ask and is right 5-10 tokens at a time where an answer copies text seen
before (an agent's edits); the target's heads (Medusa, EAGLE) or a draft model are right 1.5-2 tokens a pass on
new text; neither wins everywhere, and one request mixes both. `AutoProposer` asks the suffix tries at every
step and, where it has one, the second drafter, and values each candidate draft by what it is expected to
emit per second of the target pass it widens (and of drafting, for a draft model), from the acceptance rate
measured for each kind of guess (`controller.KindRates`: the trie labels its tokens by how sure it is and how
much context they continue, the heads by depth and how sure they are) and the measured pass costs
(`controller.CostModel`):

    value(draft cut to w tokens) = (1 + E(w)) / (t_pass(w + 1) + t_draft)     E(w) = sum_j<=w prod_l<=j rate(kind_l)

plain decoding being 1 / t_pass(1). The best candidate wins, nothing when plain decoding does; the batch's drafts
are then cut together to the width that pays (`ByKind.width`). A draft model's tokens are not labelled: when
it drafts, probes and reads a prompt is `auto_model.ModelGate`'s to decide, from its measured acceptance and
costs.

The heads are asked only for the sequences where their best case could beat the trie's draft (`_heads_bound`:
a chain of the kinds accepted most often at each depth): where a copy runs, the step saves the heads' passes and
chooses what it would have chosen anyway.

Exactness is unchanged: each sequence's draft comes whole from one drafter, point masses from the trie and the
drafter's distribution from a draft model or heads, and is verified as it would be alone.

With `tree` (and one sequence running), where the trie and the heads both have a draft and disagree on its
first token, one pass may carry both as the two branches of a tree (`_tree`): it is expected to accept the
trie's branch as before, plus, when the trie's first token is wrong, the heads' branch; it is verified when
that is worth more per second of its wider pass than the better single draft. The trie's nodes are point
masses and the heads' nodes keep their distribution: siblings drawn independently, as multi-draft rejection
sampling needs (`tree.tree_rejection_sample`), so sampling stays exact too.

Example (the default target, an agent's edit): while the answer repeats the file, the trie's draft after 16
matched tokens is 12 tokens whose kinds were accepted ~97% of the time: value 10.6 tokens for ~2.3 pass-times,
against Medusa's 2 tokens at ~0.6 (1.9 for 1.2); after the renamed identifier the trie matches 1 token (rate
~0.2) and Medusa's chain wins until the copy resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specdec.speculative.auto_model import ModelGate, ModelRow
from specdec.speculative.costs import AcceptanceEstimate, CostModel
from specdec.speculative.controller import ByKind
from specdec.speculative.proposers import Draft, Joining, PromptChunk, Proposal, Proposer, SuffixProposer


def _reach_of(rates: list[float], lean: float) -> list[float]:
    """E(w) for w = 1..len(rates) of a draft whose tokens are accepted at these rates (times `lean`, at most 1)."""
    reach, total, out = 1.0, 0.0, []
    for rate in rates:
        reach *= min(1.0, rate * lean)
        total += reach
        out.append(total)
    return out


@dataclass
class _Row:
    """What `AutoProposer` knows of one sequence."""

    seq: object  # the sequence it is for (request ids may be reused)
    lean: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # its labelled tokens' lean (`KindRates`)
    model: ModelRow | None = None  # what the draft model's gate knows of it (a draft model as second drafter)
    tree: tuple[list[int], list[int]] | None = None  # its last draft's branches' kinds, if a two-drafter tree


class AutoProposer(Proposer):
    """The suffix tries beside an optional second drafter (heads or a draft model), chosen per sequence and
    step by expected tokens per second (see the module's docstring). `k` is the second drafter's K (fixed, or
    a maximum with `adaptive`); suffix drafts hold up to the engine's K (the trie's depth). The engine runs it
    with a fixed K (`SpeculationController` asks nothing of it): the choice and the cut are made here, with the
    controller's measured costs (`bind`)."""

    def __init__(self, suffix: SuffixProposer, second: Proposer | None = None, k: int = 0, adaptive: bool = True,
                 second_name: str | None = None, probe_interval: int = 16, max_probe_interval: int = 256,
                 tree: bool = False) -> None:
        if suffix.guess_kinds == 0:
            raise ValueError("auto speculation needs the trie's chain drafts (not trees)")
        self.suffix = suffix
        self.second = second
        self.k = k if second is not None else 0
        self.adaptive = adaptive
        self.second_name = second_name or ("none" if second is None else type(second).__name__)
        self.labelled = second is not None and second.guess_kinds > 0  # heads: their tokens labelled too
        self.tree = tree and self.labelled  # two-drafter trees (the trie's branch beside the heads')
        self.offset = suffix.guess_kinds  # the second drafter's kinds follow the trie's
        self.policy = ByKind(0, suffix.guess_kinds + (second.guess_kinds if self.labelled else 0))
        # heads: asked only where their best case could beat the trie's draft (False: every step; the same choices)
        self.bound_second = True
        self._costs = CostModel()  # until then
        self._rows: dict[str, _Row] = {}
        # a draft model as second drafter (unlabelled tokens, a cost per drafted token): its gate decides
        self.gate = ModelGate(second, self.k, adaptive, lambda: self.costs, self.second_name, probe_interval,
                              max_probe_interval) if second is not None and not self.labelled else None
        if second is not None:  # what the engine asks of a drafter is the second one's: the trie needs nothing
            self.restart_tokens = second.restart_tokens
            self.cache = second.cache
            self.kv_shift = second.kv_shift
            self.feature_layers = second.feature_layers

    def bind(self, controller) -> None:
        self.controller = controller
        if self.second is not None:
            self.second.bind(controller)

    @property
    def costs(self) -> CostModel:
        return self._costs if self.controller is None else self.controller.costs

    def max_width(self, k: int) -> int:
        return max(k, self.second.max_width(min(k, self.k)) if self.second is not None else 0)

    @property
    def memory_bytes(self) -> int:
        return self.suffix.memory_bytes + (self.second.memory_bytes if self.second is not None else 0)

    def _row(self, seq) -> _Row:
        row = self._rows.get(seq.request_id)
        if row is None or row.seq is not seq:
            row = self._rows[seq.request_id] = _Row(seq, model=self.gate.new_row() if self.gate else None)
        return row

    # ------------------------------------------------------------------------------------------- valuing
    def _pass(self, rows: int) -> float | None:
        return self.costs.pass_time(rows)

    def _reach(self, kinds: list[int], lean: float) -> list[float]:
        """E(w) for w = 1..len(kinds): the expected accepted tokens of the draft cut to w tokens."""
        return _reach_of([self.policy.rates.rate(kind) for kind in kinds], lean)

    def _value(self, kinds: list[int], lean: float) -> float:
        """The most tokens per second the labelled draft gives, cut where it pays best (0 cut: plain)."""
        return self._value_of([self.policy.rates.rate(kind) for kind in kinds], lean)

    def _value_of(self, rates: list[float], lean: float) -> float:
        base = self._pass(1)
        reach = _reach_of(rates, lean)
        if base is None:  # nothing measured yet: the expected tokens alone
            return 1.0 + (reach[-1] if reach else 0.0)
        best = 1.0 / base
        for w, e in enumerate(reach, start=1):
            best = max(best, (1.0 + e) / self._pass(w + 1))
        return best

    def _heads_bound(self, k: int, lean: float) -> float:
        """What no draft of the heads up to k tokens can value more than: the value of a chain whose token
        at each depth is of the kind accepted most often at that depth (every rate at least its draft's)."""
        rates = self.policy.rates.rate
        depth = min(k, self.second.max_depth)  # (the heads draft no deeper)
        return self._value_of([max(rates(self.offset + kind) for kind in self.second.kinds_at(d))
                               for d in range(depth)], lean)

    # ------------------------------------------------------------------------------------------- drafting
    def propose(self, seqs, ks) -> Proposal:
        if max(ks, default=0) == 0:
            return Proposal([Draft([]) for _ in seqs])
        rows = [self._row(seq) for seq in seqs]
        drafts = [replace(d, source="suffix") for d in self.suffix.draft(seqs, ks)]
        tries, heads = list(drafts), [None] * len(seqs)  # each drafter's own draft (for `_tree`)
        values = [self._value(d.kinds or [], row.lean.lean) for d, row in zip(drafts, rows)]
        forward = None
        if self.labelled:
            # the heads are asked for the rows where their best case could beat the trie's draft (the choice
            # below is the same without asking them where it cannot: a step's heads pass saved where a copy runs)
            asks = [min(k, self.k) if self.tree or not self.bound_second or not drafts[b].tokens
                    or self._heads_bound(min(k, self.k), rows[b].lean.lean) > values[b] else 0
                    for b, k in enumerate(ks)]
            second = []  # (none asked: nothing to weigh)
            if any(asks):
                t0 = self.clock()
                second = self.second.draft(seqs, asks)
                forward = self.clock() - t0
            for b, (d, row) in enumerate(zip(second, rows)):
                if not d.tokens:
                    continue
                d = heads[b] = replace(d, kinds=[self.offset + kind for kind in d.kinds], source=self.second_name)
                value = self._value(d.kinds, row.lean.lean)
                if value > values[b] or not drafts[b].tokens:
                    drafts[b], values[b] = d, value
        elif self.gate is not None:
            drafts, forward = self.gate.draft(seqs, ks, [row.model for row in rows], drafts, values)
        if all(d.kinds is not None or not d.tokens for d in drafts):  # the batch's drafts cut where they pay
            w = self.policy.width([d.kinds or [] for d in drafts], [row.lean.lean for row in rows], self.costs)
            drafts = [d if len(d.tokens) <= w else replace(d, tokens=d.tokens[:w], kinds=d.kinds[:w],
                                                           probs=None if d.probs is None else d.probs[:w])
                      for d in drafts]
        for row in rows:
            row.tree = None
        if self.tree and len(seqs) == 1:  # (in a batch the widest draft widens every row's pass)
            drafts = [self._tree(drafts[0], tries[0], heads[0], rows[0], ks[0])]
        return Proposal(drafts, forward)

    def _tree(self, chosen: Draft, trie: Draft, heads: Draft | None, row: _Row, k: int) -> Draft:
        """The trie's and the heads' drafts as one tree (cut to the widths that pay, `k` nodes at most) where
        that is expected to give more tokens per second than `chosen`, the better of them; else `chosen`."""
        base = self._pass(1)
        if heads is None or not trie.tokens or not heads.tokens or trie.tokens[0] == heads.tokens[0] or base is None:
            return chosen
        lean = row.lean.lean
        single = (1.0 + self._reach(chosen.kinds, lean)[-1]) / self._pass(len(chosen.tokens) + 1) \
            if chosen.tokens and chosen.kinds else 1.0 / base
        reach_t, reach_h = self._reach(trie.kinds, lean), self._reach(heads.kinds, lean)
        miss = 1.0 - reach_t[0]  # the heads' branch counts where the trie's first token is wrong
        best, widths = single, None
        for wt in range(1, min(len(reach_t), k - 1) + 1):
            for wh in range(1, min(len(reach_h), k - wt) + 1):
                value = (1.0 + reach_t[wt - 1] + miss * reach_h[wh - 1]) / self._pass(wt + wh + 1)
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

    # ------------------------------------------------------------------------------------------- the rest
    def prefill(self, seq, start: int, stop: int) -> int:
        return self.second.prefill(seq, start, stop) if self.second is not None else 0

    def read_prompt(self, chunk: PromptChunk) -> None:
        self.suffix.read_prompt(chunk)
        if self.second is None:
            return
        if self.gate is None or self._model_reads(chunk.seq, chunk.start, chunk.batch.batch_size):
            self.second.read_prompt(chunk)

    def _model_reads(self, seq, start: int, batch_size: int) -> bool:
        return self.gate.reads(self._row(seq).model, seq, start, batch_size)

    def usable_prefix(self, prefix, chain: list) -> int:
        return self.second.usable_prefix(prefix, chain) if self.second is not None else len(chain)

    @property
    def usable_tail(self) -> bool:
        return self.second.usable_tail if self.second is not None else True

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        if self.second is None or (self.gate is not None and not self._model_reads(seq, 0, batch.batch_size)):
            return cached
        return self.second.restore_prefix(seq, prefix, chain, cached, batch)

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        self.suffix.observe(seqs, drafts, verdicts)
        if self.second is not None:
            self.second.observe(seqs, drafts, verdicts, hidden)
        self.policy.rates.step()
        for seq, draft, verdict in zip(seqs, drafts, verdicts):
            row = self._row(seq)
            if not draft.tokens or (draft.kinds is None and row.tree is None):  # no labelled token verified
                self.policy.rates.relax(row.lean)
            if not draft.tokens:
                continue
            if draft.parents is not None and row.tree is not None:  # each branch learns what it got
                trie_kinds, heads_kinds = row.tree
                path = verdict.kept()
                on_trie = bool(path) and path[0] < len(trie_kinds)
                self.policy.rates.learn(trie_kinds, len(path) if on_trie else 0, row.lean)
                self.policy.rates.learn(heads_kinds, len(path) if path and not on_trie else 0, row.lean)
            elif draft.kinds is not None:
                self.policy.rates.learn(draft.kinds, verdict.num_accepted, row.lean)
            elif row.model is not None:
                self.gate.observe(row.model, len(draft.tokens), verdict.num_accepted)

    def release(self, seq) -> None:
        self.suffix.release(seq)
        if self.second is not None:
            self.second.release(seq)
        row = self._rows.get(seq.request_id)
        if row is not None and row.seq is seq:
            del self._rows[seq.request_id]

    def preempt(self, seq) -> None:
        self.suffix.preempt(seq)
        if self.second is not None:
            self.second.preempt(seq)
        row = self._rows.get(seq.request_id)
        if row is not None and row.seq is seq:  # (what the gate knew of the draft model's row: gone with it)
            del self._rows[seq.request_id]

    def cached_tokens(self, seq) -> int:
        return self.second.cached_tokens(seq) if self.second is not None else 0
