"""When auto speculation's draft model drafts, probes and reads a prompt (`ModelGate`), beside the suffix tries.

A draft model's tokens are not labelled by kind as the trie's and the heads' are: its value comes from the
sequence's measured acceptance rate under the geometric model (Leviathan et al.), its cost from its measured
forwards plus the tokens it must first catch up on (those of the trie's accepted drafts, at its prompt-reading
cost). It drafts where that beats both the trie's draft and plain decoding: K tokens with K fixed
(`--num-speculative-tokens K`), the best K up to the configured one when adaptive; and it is tried again now
and then after it has lost (`probe_interval` steps, doubling while it keeps losing, up to
`max_probe_interval`), so that text on which it starts to agree is noticed, where a draft at a high acceptance
(`OPTIMISTIC`) could pay at all. A draft model too slow beside its target to pay on a machine (a 0.5B draft at
0.66 of a 1.5B pass, each verified row at 0.5-0.64 of one: measured on a 2-core AVX2 EPYC) is then never run,
and it reads a joining prompt only where drafting is expected to repay the reading (`reading_pays`).

Example: the trie's draft is worth 12 tokens/s and plain decoding 10; at the sequence's measured rate 0.6 the
model's best K gives 11 tokens/s: the trie drafts. 16 steps later the model is probed (1 token, adaptive)
if a draft at 0.95 would beat 12; losing again, it waits 32 steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from specdec.speculative.costs import AcceptanceEstimate, CostModel, expected_tokens
from specdec.speculative.proposers import Draft, Proposer


@dataclass
class ModelRow:
    """What `ModelGate` knows of one sequence."""

    rate: AcceptanceEstimate  # its draft-model acceptance
    idle: int = 0  # steps since the draft model last drafted for it
    reads: bool | None = None  # whether the draft model reads its prompt (decided at its first prompt chunk)
    probe_every: int = 0  # steps between its probes of the draft model


@dataclass
class ModelGate:
    """The draft model `model` (K `k`, a maximum when `adaptive`) drafting where it pays, with the costs that
    `costs()` gives (the controller's, once bound)."""

    MODEL_PRIOR = 0.8  # a draft model's acceptance rate before it is measured
    OPTIMISTIC = 0.95  # the rate at which a draft model's draft is judged able to pay at all (probes)
    SHARE_DECAY = 0.95  # `share`: each sequence's step weighs 1/20 (the last few dozen steps count)

    model: Proposer
    k: int
    adaptive: bool
    costs: Callable[[], CostModel]
    name: str
    probe_interval: int = 16
    max_probe_interval: int = 256
    read_rate: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate.with_prior(ModelGate.MODEL_PRIOR))
    # of the recent steps that wanted a draft, the share in which the model's was worth more than the trie's and
    # plain decoding's (its probes not counted): what reading a prompt can pay off on (`reading_pays`)
    share: float = 1.0

    def new_row(self) -> ModelRow:
        return ModelRow(AcceptanceEstimate.with_prior(self.MODEL_PRIOR), probe_every=self.probe_interval)

    def choice(self, rate: float, limit: int, batch: int, behind: int = 0) -> tuple[int, float]:
        """(K, tokens per second) of the draft model at acceptance `rate`: K fixed (the configured one, within
        `limit`), or the best up to it; `behind`: the tokens it must read first beyond the usual two (a
        catch-up after the trie's accepted drafts, or a restart), at its prompt-reading cost. Before its
        drafting is measured at this batch size its value is infinite: it runs, and is measured."""
        costs = self.costs()
        t_draft, base = costs.draft_time(batch), costs.pass_time(1)
        ks = range(1, limit + 1) if self.adaptive else [limit]
        if limit <= 0:
            return 0, 0.0
        if t_draft is None or base is None:
            return max(ks), float("inf")
        catch_up = (costs.draft_prefill_time(behind) or 0.0) if behind > 0 else 0.0
        best_k, best = 0, 0.0
        for k in ks:
            value = expected_tokens(rate, k) / (catch_up + k * t_draft + costs.pass_time(k + 1))
            if value > best:
                best_k, best = k, value
        return best_k, best

    def reading_pays(self, batch: int, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether the draft model should read a joining prompt: if drafting at the acceptance measured on read
        prompts beats plain decoding by more, over the `share` of `output_tokens` on which it has lately been
        the drafter (not the trie), than the reading costs. Not before its costs are measured: unread, it
        drafts from a restart on a short window (`DraftModelProposer.window`), which measures them at the cost
        of a short read, where reading a 200-token prompt first took a third of the first request's time on a
        2-core AVX2 machine on which the draft never pays. Measured on an agent's second edit turn (the seed's
        command, `max_tokens` 4000, a 2.2k-token prompt; 2-core Sapphire Rapids), before `share`: the whole
        prompt read before the first token, 11.7 s against 0.32 s, for an answer the trie drafted most of."""
        costs = self.costs()
        base, reading = costs.pass_time(1), costs.draft_prefill_time(prompt_tokens)
        _, value = self.choice(self.read_rate.rate, self.k, batch)
        if base is None or reading is None or value == float("inf"):
            return False
        return value > 1.0 / base and output_tokens * self.share * (base - 1.0 / value) > reading

    def reads(self, row: ModelRow, seq, start: int, batch_size: int) -> bool:
        """Whether the draft model reads `seq`'s prompt (from `start`), decided once per sequence."""
        if row.reads is None:
            row.reads = self.reading_pays(batch_size, len(seq.tokens) - 1 - start,
                                          seq.params.max_tokens - seq.num_output)
        return row.reads

    def draft(self, seqs, ks, rows: list[ModelRow], drafts: list[Draft], values: list[float]):
        """The draft model drafts for the sequences where it is worth more than the trie's draft and plain
        decoding (`values` are at least plain's), and probes where it has been idle long enough and could pay
        at all; one batched run for all of them. Returns (drafts, its forward seconds or None)."""
        model_ks = []
        for seq, k, row, value in zip(seqs, ks, rows, values):
            limit, behind = min(k, self.k), max(0, self.model.behind(seq) - 2)
            k_model, model_value = self.choice(row.rate.rate, limit, len(seqs), behind)
            probe = row.idle >= row.probe_every and self.choice(self.OPTIMISTIC, limit, len(seqs), behind)[1] > value
            won = k_model > 0 and model_value > value
            use = won or (k_model > 0 and probe)
            if k > 0:
                self.share += (1 - self.SHARE_DECAY) * (won - self.share)
            if use and not won:  # a probe
                row.probe_every = min(2 * row.probe_every, self.max_probe_interval)
                k_model = 1 if self.adaptive else k_model
            elif use:
                row.probe_every = self.probe_interval
            model_ks.append(k_model if use else 0)
            row.idle = 0 if use else row.idle + 1
        if not any(model_ks):
            return drafts, None
        proposal = self.model.propose(seqs, model_ks)
        drafts = [replace(proposal.drafts[b], source=self.name) if k else d
                  for b, (k, d) in enumerate(zip(model_ks, drafts))]
        return drafts, proposal.forward_seconds

    def observe(self, row: ModelRow, num_drafted: int, num_accepted: int) -> None:
        """A draft of the model's was verified: its rate, and the rate on read prompts if it read this one."""
        row.rate.update(num_drafted, num_accepted, 0.9)
        if row.reads:
            self.read_rate.update(num_drafted, num_accepted, 0.9)
