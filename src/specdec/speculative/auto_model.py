"""Auto speculation beside a draft model: when it drafts, probes and reads a prompt, beside the suffix tries.

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

from dataclasses import dataclass, replace

from specdec.speculative.auto import AutoProposer, AutoRow
from specdec.speculative.costs import AcceptanceEstimate, expected_tokens
from specdec.speculative.proposers import Draft, Joining, PromptChunk, Proposal, Proposer, SuffixProposer


@dataclass(kw_only=True)
class _ModelRow(AutoRow):
    rate: AcceptanceEstimate  # its draft-model acceptance
    idle: int = 0  # steps since the draft model last drafted for it
    reads: bool | None = None  # whether the draft model reads its prompt (decided at its first prompt chunk)
    probe_every: int = 0  # steps between its probes of the draft model


class AutoModelProposer(AutoProposer):
    """The suffix tries beside the draft model `model` (a proposer of unlabelled tokens; K `k`, a maximum when
    `adaptive`), which drafts where it pays (see the module's docstring); `name` is its drafts' source."""

    MODEL_PRIOR = 0.8  # a draft model's acceptance rate before it is measured
    OPTIMISTIC = 0.95  # the rate at which a draft model's draft is judged able to pay at all (probes)
    SHARE_DECAY = 0.95  # `share`: each sequence's step weighs 1/20 (the last few dozen steps count)

    def __init__(self, suffix: SuffixProposer, model: Proposer, k: int, adaptive: bool = True,
                 name: str = "draft_model", probe_interval: int = 16, max_probe_interval: int = 256) -> None:
        super().__init__(suffix, model, k, name)
        self.adaptive = adaptive
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.read_rate = AcceptanceEstimate.with_prior(self.MODEL_PRIOR)  # its acceptance on prompts it read
        # of the recent steps that wanted a draft, the share in which the model's was worth more than the trie's
        # and plain decoding's (its probes not counted): what reading a prompt can pay off on (`reading_pays`)
        self.share = 1.0

    def _new_row(self, seq) -> _ModelRow:
        return _ModelRow(seq, rate=AcceptanceEstimate.with_prior(self.MODEL_PRIOR), probe_every=self.probe_interval)

    def choice(self, rate: float, limit: int, batch: int, behind: int = 0) -> tuple[int, float]:
        """(K, tokens per second) of the draft model at acceptance `rate`: K fixed (the configured one, within
        `limit`), or the best up to it; `behind`: the tokens it must read first beyond the usual two (a
        catch-up after the trie's accepted drafts, or a restart), at its prompt-reading cost. Before its
        drafting is measured at this batch size its value is infinite: it runs, and is measured."""
        costs = self.costs
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
        costs = self.costs
        base, reading = costs.pass_time(1), costs.draft_prefill_time(prompt_tokens)
        _, value = self.choice(self.read_rate.rate, self.k, batch)
        if base is None or reading is None or value == float("inf"):
            return False
        return value > 1.0 / base and output_tokens * self.share * (base - 1.0 / value) > reading

    def _reads(self, seq, start: int, batch_size: int) -> bool:
        """Whether the draft model reads `seq`'s prompt (from `start`), decided once per sequence."""
        row = self._row(seq)
        if row.reads is None:
            row.reads = self.reading_pays(batch_size, len(seq.tokens) - 1 - start,
                                          seq.params.max_tokens - seq.num_output)
        return row.reads

    def _choose(self, seqs, ks, rows: list[_ModelRow], tries: list[Draft]) -> Proposal:
        """The draft model drafts for the sequences where it is worth more than the trie's draft and plain
        decoding (the values are at least plain's), and probes where it has been idle long enough and could pay
        at all; one batched run for all of them."""
        values, model_ks = self._values(tries, rows), []
        for seq, k, row, value in zip(seqs, ks, rows, values):
            limit, behind = min(k, self.k), max(0, self.second.behind(seq) - 2)
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
            return Proposal(self._cut(tries, rows))
        proposal = self.second.propose(seqs, model_ks)
        drafts = [replace(proposal.drafts[b], source=self.second_name) if k else d
                  for b, (k, d) in enumerate(zip(model_ks, tries))]
        return Proposal(self._cut(drafts, rows), proposal.forward_seconds)

    def _learn(self, row: _ModelRow, draft: Draft, verdict) -> None:
        """Also, where a draft of the model's was verified: its rate, and the rate on read prompts if it read
        this one."""
        super()._learn(row, draft, verdict)
        if draft.tokens and draft.kinds is None:
            row.rate.update(len(draft.tokens), verdict.num_accepted, 0.9)
            if row.reads:
                self.read_rate.update(len(draft.tokens), verdict.num_accepted, 0.9)

    def read_prompt(self, chunk: PromptChunk) -> None:
        self.suffix.read_prompt(chunk)
        if self._reads(chunk.seq, chunk.start, chunk.batch.batch_size):
            self.second.read_prompt(chunk)

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        if not self._reads(seq, 0, batch.batch_size):
            return cached
        return super().restore_prefix(seq, prefix, chain, cached, batch)
