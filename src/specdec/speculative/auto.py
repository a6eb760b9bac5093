"""Auto speculation: for each sequence and step, the drafter expected to give the most tokens per second.

Suffix decoding costs nothing to ask and is right 5-10 tokens at a time where an answer copies text seen
before (an agent's edits); the target's heads (Medusa, EAGLE) or a draft model are right 1.5-2 tokens a pass on
new text; neither wins everywhere, and one request mixes both. An auto proposer asks the suffix tries at every
step and, where it has one, a second drafter, and values each candidate draft by what it is expected to emit
per second of the target pass it widens (and of drafting, for a draft model), from the acceptance rate measured
for each kind of guess (`controller.KindRates`: the trie labels its tokens by how sure it is and how much
context they continue, the heads by depth and how sure they are) and the measured pass costs
(`controller.CostModel`):

    value(draft cut to w tokens) = (1 + E(w)) / (t_pass(w + 1) + t_draft)     E(w) = sum_j<=w prod_l<=j rate(kind_l)

plain decoding being 1 / t_pass(1). The best candidate wins, nothing when plain decoding does; the batch's drafts
are then cut together to the width that pays (`ByKind.width`).

`AutoProposer` is the trie alone (its second drafter the `NullProposer`) and what the two policies for a second
drafter share: the trie's drafts and their values, the cut, learning the kinds' rates from the verdicts, and
handing the engine's other questions to the second drafter. The policies:

- `auto_heads.AutoHeadsProposer`: heads, whose tokens are labelled as the trie's: asked only where their best
  case could beat the trie's draft, and with `tree` both drafts as one tree's two branches where that pays;
- `auto_model.AutoModelProposer`: a draft model, whose tokens are not labelled: a gate on its measured
  acceptance and costs decides when it drafts, probes and reads a prompt.

Exactness is unchanged: each sequence's draft comes whole from one drafter, point masses from the trie and the
drafter's distribution from a draft model or heads, and is verified as it would be alone.

Example (the default target, an agent's edit): while the answer repeats the file, the trie's draft after 16
matched tokens is 12 tokens whose kinds were accepted ~97% of the time: value 10.6 tokens for ~2.3 pass-times,
against Medusa's 2 tokens at ~0.6 (1.9 for 1.2); after the renamed identifier the trie matches 1 token (rate
~0.2) and Medusa's chain wins until the copy resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdec.speculative.controller import ByKind
from specdec.speculative.costs import AcceptanceEstimate, CostModel
from specdec.speculative.proposers import Draft, Joining, PromptChunk, Proposal, Proposer, SuffixProposer


def reach_of(rates: list[float], lean: float) -> list[float]:
    """E(w) for w = 1..len(rates) of a draft whose tokens are accepted at these rates (times `lean`, at most 1)."""
    reach, total, out = 1.0, 0.0, []
    for rate in rates:
        reach *= min(1.0, rate * lean)
        total += reach
        out.append(total)
    return out


@dataclass
class AutoRow:
    """What an auto proposer knows of one sequence (its policy's rows add to it)."""

    seq: object  # the sequence it is for (request ids may be reused)
    lean: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # its labelled tokens' lean (`KindRates`)


class AutoProposer(Proposer):
    """The suffix tries beside a second drafter (`NullProposer`: the trie alone), chosen per sequence and step
    by expected tokens per second (see the module's docstring). `k` is the second drafter's K; suffix drafts
    hold up to the engine's K (the trie's depth); `second_kinds` the kinds of the second drafter's labelled
    tokens, which follow the trie's. The engine runs it with a fixed K (`SpeculationController` asks nothing
    of it): the choice and the cut are made here, with the controller's measured costs (`bind`)."""

    def __init__(self, suffix: SuffixProposer, second: Proposer, k: int = 0, second_name: str = "none",
                 second_kinds: int = 0) -> None:
        if suffix.guess_kinds == 0:
            raise ValueError("auto speculation needs the trie's chain drafts (not trees)")
        self.suffix, self.second, self.k, self.second_name = suffix, second, k, second_name
        self.policy = ByKind(0, suffix.guess_kinds + second_kinds)
        self._costs = CostModel()  # until bound
        self._rows: dict[str, AutoRow] = {}
        # what the engine asks of a drafter is the second one's: the trie needs nothing
        self.restart_tokens = second.restart_tokens
        self.cache = second.cache
        self.kv_shift = second.kv_shift
        self.feature_layers = second.feature_layers

    def bind(self, controller) -> None:
        super().bind(controller)
        self.second.bind(controller)

    @property
    def costs(self) -> CostModel:
        return self._costs if self.controller is None else self.controller.costs

    def _row(self, seq) -> AutoRow:
        row = self._rows.get(seq.request_id)
        if row is None or row.seq is not seq:
            row = self._rows[seq.request_id] = self._new_row(seq)
        return row

    def _new_row(self, seq) -> AutoRow:
        return AutoRow(seq)

    # ------------------------------------------------------------------------------------------- valuing
    def _value(self, kinds: list[int], lean: float) -> float:
        """The most tokens per second the labelled draft gives, cut where it pays best (0 cut: plain)."""
        return self._value_of([self.policy.rates.rate(kind) for kind in kinds], lean)

    def _value_of(self, rates: list[float], lean: float) -> float:
        base = self.costs.pass_time(1)
        reach = reach_of(rates, lean)
        if base is None:  # nothing measured yet: the expected tokens alone
            return 1.0 + (reach[-1] if reach else 0.0)
        best = 1.0 / base
        for w, e in enumerate(reach, start=1):
            best = max(best, (1.0 + e) / self.costs.pass_time(w + 1))
        return best

    # ------------------------------------------------------------------------------------------- drafting
    def propose(self, seqs, ks) -> Proposal:
        if max(ks, default=0) == 0:
            return Proposal([Draft([]) for _ in seqs])
        rows = [self._row(seq) for seq in seqs]
        tries = [replace(d, source="suffix") for d in self.suffix.draft(seqs, ks)]
        return self._choose(seqs, ks, rows, tries)

    def _choose(self, seqs, ks, rows: list[AutoRow], tries: list[Draft]) -> Proposal:
        """The step's drafts, given the trie's (`tries`): the trie alone drafts them, cut where they pay."""
        return Proposal(self._cut(tries, rows))

    def _values(self, drafts: list[Draft], rows: list[AutoRow]) -> list[float]:
        return [self._value(d.kinds or [], row.lean.lean) for d, row in zip(drafts, rows)]

    def _cut(self, drafts: list[Draft], rows: list[AutoRow]) -> list[Draft]:
        """The batch's drafts cut together to the width that pays, if all of their tokens are labelled."""
        if not all(d.kinds is not None or not d.tokens for d in drafts):
            return drafts
        w = self.policy.width([d.kinds or [] for d in drafts], [row.lean.lean for row in rows], self.costs)
        return [d if len(d.tokens) <= w else replace(d, tokens=d.tokens[:w], kinds=d.kinds[:w],
                                                     probs=None if d.probs is None else d.probs[:w])
                for d in drafts]

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        self.suffix.observe(seqs, drafts, verdicts)
        self.second.observe(seqs, drafts, verdicts, hidden)
        self.policy.rates.step()
        for seq, draft, verdict in zip(seqs, drafts, verdicts):
            self._learn(self._row(seq), draft, verdict)

    def _learn(self, row: AutoRow, draft: Draft, verdict) -> None:
        """What a row's verdict teaches: the rates of its labelled tokens' kinds, if any were verified; else its
        lean decays toward 1, as a learning step's does."""
        if draft.tokens and draft.kinds is not None:
            self.policy.rates.learn(draft.kinds, verdict.num_accepted, row.lean)
        else:
            self.policy.rates.relax(row.lean)

    # ------------------------------------------------------------------------------------------- the rest
    def max_width(self, k: int) -> int:
        return max(k, self.second.max_width(min(k, self.k)))

    @property
    def memory_bytes(self) -> int:
        return self.suffix.memory_bytes + self.second.memory_bytes

    def prefill(self, seq, start: int, stop: int) -> int:
        return self.second.prefill(seq, start, stop)

    def read_prompt(self, chunk: PromptChunk) -> None:
        self.suffix.read_prompt(chunk)
        self.second.read_prompt(chunk)

    def usable_prefix(self, prefix, chain: list) -> int:
        return self.second.usable_prefix(prefix, chain)

    @property
    def usable_tail(self) -> bool:
        return self.second.usable_tail

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        return self.second.restore_prefix(seq, prefix, chain, cached, batch)

    def cached_tokens(self, seq) -> int:
        return self.second.cached_tokens(seq)

    def release(self, seq) -> None:
        self.suffix.release(seq)
        self.second.release(seq)
        self._forget(seq)

    def preempt(self, seq) -> None:
        self.suffix.preempt(seq)
        self.second.preempt(seq)
        self._forget(seq)

    def _forget(self, seq) -> None:
        """Its row (what a policy knew of the sequence goes with it)."""
        row = self._rows.get(seq.request_id)
        if row is not None and row.seq is seq:
            del self._rows[seq.request_id]
