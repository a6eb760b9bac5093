"""The draft model proposer: a smaller model of the same family drafts one token per forward, with its own
K/V cache rolled back with the target's (`DraftModelProposer`), over the whole vocabulary or the part
`draft_vocabulary` keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import process_logits, sample
from specdec.speculative.proposers import Draft, Joining, PromptChunk, Proposal, Proposer


def draft_vocabulary(size: int | None, vocab_size: int, keep) -> torch.Tensor | None:
    """The token ids a draft model proposes with `draft_vocab_size=size`: the ids below `size` (a byte-level
    BPE numbers its tokens in the order of its merges, so the first ids are its most frequent pieces), plus
    `keep` (the special tokens: end of turn, tool calls). None: all of them (size None, or not smaller than
    the vocabulary). Example: Qwen2.5's first 65536 ids hold 98.7% of the tokens of HumanEval's prompts and
    solutions, and 97.6% over Spec-Bench's questions with them."""
    if size is None or size >= vocab_size:
        return None
    ids = set(range(size)) | {int(i) for i in keep if 0 <= int(i) < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


@dataclass
class _DraftRow:
    """A draft model's state for one sequence."""

    skipped: int = 0  # leading tokens of the sequence not in the draft cache (it restarted on a window)
    drafted_from: int | None = None  # len(seq.tokens) when this step's draft began; None: no draft this step


class DraftModelProposer(Proposer):
    """A smaller model of the same family, with its own KV cache rolled back with the target's.

    The draft cache holds the K/V of a stretch of each sequence. It reads each prompt chunk the target
    prefills (`read_prompt`), or the blocks a prefix cache holds for it, where its controller expects the
    batch to speculate (`SpeculationController.draft_reads_prompt`). A proposal first feeds each row
    the tokens it lacks (usually 1; 2 after a fully accepted draft: the last drafted token and the bonus
    token; more after steps without speculation), all rows in one forward, then drafts one token per
    forward.

    A row more than `window` tokens behind (speculation was off for a while, or the engine did not feed
    it the prompt) restarts on the last `window` tokens only, at their true positions: feeding all it
    missed would cost a prefill, which is what made a draft that never agrees (probed now and then)
    slower than plain decoding. Its state counts the tokens before them (`_DraftRow.skipped`). The draft
    then sees less context, which can only lower its acceptance, never change the output.

    `vocab` (sorted token ids, see `draft_vocabulary`): the draft proposes only these tokens, and computes
    only their logits. Its output layer is then a fraction of its cost (the 0.5B draft's 152k-row lm_head
    is 40% of its weights); its distribution, for rejection sampling, is its softmax over them, zero elsewhere.
    """

    kv_shift = 0  # slot s of a row holds the K/V of token s

    def __init__(self, model, max_batch_size: int, capacity: int, prefill_chunk: int = 512,
                 window: int = 16, vocab: torch.Tensor | None = None) -> None:
        self.model = model
        self.vocab = None if vocab is None else vocab.to(model.device)
        self.head = None if vocab is None else model.output_rows(vocab)
        self.cache = model.new_cache(max_batch_size, capacity)
        self.prefill_chunk = prefill_chunk
        self.window = window
        self.restart_tokens = window

    @staticmethod
    def state(seq) -> _DraftRow:
        if seq.draft_state is None:
            seq.draft_state = _DraftRow()
        return seq.draft_state

    def _consumed(self, seq) -> int:
        """Tokens of `seq` that the draft has seen (or skipped)."""
        return self.state(seq).skipped + self.cache.lengths[seq.row]

    def behind(self, seq) -> int:
        """Tokens of `seq` its next proposal feeds before drafting (1 or 2 while it keeps drafting; at most
        `window` + 1: a row further behind restarts on a window)."""
        return min(len(seq.tokens) - self._consumed(seq), self.window + 1)

    def cached_tokens(self, seq) -> int:
        """Leading tokens of `seq` whose K/V the draft cache holds (none after a restart)."""
        return 0 if self.state(seq).skipped else self.cache.lengths[seq.row]

    @property
    def memory_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
        if self.head is not None:
            weights += sum(t.numel() * t.element_size() for t in [*self.head.parameters(), *self.head.buffers()])
        return weights + self.cache.nbytes

    def prefill(self, seq, start: int, stop: int) -> int:
        """Feed prompt tokens [start, stop) of `seq` (the chunk the target was just fed), in chunks of
        `prefill_chunk`; nothing if the row is not at `start` (it catches up at its first proposal).
        Returns how many tokens it fed."""
        row = seq.row
        if self._consumed(seq) != start:
            return 0
        fed = stop - start
        device = self.model.device
        while start < stop:
            end = min(stop, start + self.prefill_chunk)
            chunk = torch.tensor([seq.tokens[start:end]], device=device)
            self.model(chunk, torch.arange(start, end, device=device)[None], self.cache.row_view(row), num_logits=1,
                       head=self.head)
            self.cache.advance(row, end - start)
            start = end
        return fed

    def read_prompt(self, chunk: PromptChunk) -> None:
        if self._reads(chunk.seq, chunk.start, chunk.batch):
            self._timed_prefill(chunk.seq, chunk.start, chunk.stop)

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        """The blocks of `chain` it has cached (possibly fewer: it had restarted on a window), and it reads the
        rest itself, if it reads this prompt at all; otherwise it gets nothing, as when it skips a prompt."""
        held = chain[:prefix.held("draft", chain)]
        if self._reads(seq, len(held) * prefix.block_size, batch):
            self._timed_prefill(seq, prefix.load("draft", held, self.cache, seq.row), cached)
        return cached

    def _reads(self, seq, start: int, batch: Joining) -> bool:
        """Whether it reads the prompt of `seq` from token `start` on, as the controller decides for the batch
        `seq` joins. If so, `seq` gets the acceptance prior of sequences whose prompt was read."""
        controller = self.controller
        reads = controller.draft_reads_prompt([s.estimate for s in batch.running], batch.batch_size,
                                              len(seq.tokens) - 1 - start, seq.params.max_tokens - seq.num_output)
        if reads and not seq.estimate.read_prompt:  # its acceptance is then that of drafts with their context
            seq.estimate = controller.new_estimate(read_prompt=True)
        return reads

    def _timed_prefill(self, seq, start: int, stop: int) -> None:
        """Read prompt tokens [start, stop) of `seq`, counted as draft time (and as the draft's prefill cost)."""
        t0 = self.clock()
        read = self.prefill(seq, start, stop)
        t1 = self.clock()
        seq.metrics.draft_time += t1 - t0
        self.controller.record_prefill("draft", read, t1 - t0)

    def _pick(self, seq, logits: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft's token for `seq` from logits [V]: argmax when greedy, else a seeded draw. Under a grammar
        the logits are masked in the state after the `drafted` tokens: the draft proposes only what the
        grammar allows (its distribution, as reported for rejection sampling, is the masked one)."""
        if self.vocab is not None:
            if seq.params.greedy and seq.matcher is None:
                return int(self.vocab[logits.argmax()]), None
            logits = logits.new_full((self.model.config.vocab_size,), float("-inf")).index_copy_(0, self.vocab, logits)
        if seq.matcher is not None:
            allowed = seq.matcher.masks_along(drafted)[0][-1].to(logits.device)
            logits = logits.float().masked_fill(~allowed, float("-inf"))
            if self.vocab is not None and not bool(torch.isfinite(logits).any()):
                # none of the vocabulary's tokens is allowed here: propose one the grammar allows, uniformly
                logits = torch.zeros_like(logits).masked_fill(~allowed, float("-inf"))
        if seq.params.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits[None], seq.params)[0]
        return sample(probs, seq.generator), probs

    def propose(self, seqs, ks) -> Proposal:
        k_max = max(ks, default=0)
        if k_max == 0:
            return Proposal([Draft([]) for _ in seqs])
        device = self.model.device
        for seq in seqs:
            state, n = self.state(seq), len(seq.tokens)
            if n - self._consumed(seq) > self.window + 1:  # restart the row on the last `window` tokens
                state.skipped = n - 1 - self.window
                self.cache.truncate(seq.row, 0)
            state.drafted_from = n
        B = len(seqs)
        consumed = [self._consumed(seq) for seq in seqs]
        pending = [seq.tokens[c:] for seq, c in zip(seqs, consumed)]  # 1 or 2 tokens each, usually
        width = max(len(p) for p in pending)
        inputs = [p + [p[-1]] * (width - len(p)) for p in pending]  # right-pad; pads are never committed
        positions = [list(range(c, c + width)) for c in consumed]
        last = [len(p) - 1 for p in pending]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # the cost of a drafting forward: a first forward wider than 2 tokens is a catch-up, left out
        timed_from, catch_up = (None, 1) if width > 2 else (self.clock(), 0)
        for step in range(k_max):
            logits = self.model(
                torch.tensor(inputs, device=device), torch.tensor(positions, device=device), self.cache, head=self.head
            )  # [B, width, V] (V: len(vocab) with a vocabulary)
            for b, seq in enumerate(seqs):
                if step == 0:
                    self.cache.advance(seq.row, len(pending[b]))
                if step < ks[b]:  # a row with its ks[b] tokens rides along uncommitted (no cache growth)
                    if step > 0:
                        self.cache.advance(seq.row, 1)
                    token, p = self._pick(seq, logits[b, last[b]], tokens[b])
                    tokens[b].append(token)
                    if p is not None:
                        probs[b].append(p)
            if timed_from is None and k_max > 1:
                timed_from = self.clock()
            if step + 1 < k_max:
                inputs = [[t[-1] if t else seq.tokens[-1]] for t, seq in zip(tokens, seqs)]
                positions = [[self._consumed(s)] for s in seqs]
                last = [0] * B
        seconds = (self.clock() - timed_from) / (k_max - catch_up) if k_max > catch_up else None
        drafts = [Draft(tokens[b][:ks[b]], torch.stack(probs[b][:ks[b]]) if probs[b] and ks[b] else None)
                  for b in range(B)]
        return Proposal(drafts, seconds)

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        """Roll the draft cache back to the tokens the target kept (the drafted token fed last is kept
        only if accepted; the recovered/bonus token is fed at the next proposal)."""
        for seq, verdict in zip(seqs, verdicts):
            state = self.state(seq)
            if state.drafted_from is None:  # the draft model did not run this step
                continue
            keep = state.drafted_from + verdict.num_accepted - state.skipped
            self.cache.truncate(seq.row, min(keep, self.cache.lengths[seq.row]))
            state.drafted_from = None  # this step's only: the engine observes steps without drafting too
