"""Proposers: who drafts the next tokens. One small interface, batch-first.

A proposer sees the running sequences (their token ids, sampling settings, generator and cache row),
is asked for up to `ks[i]` tokens for sequence i, and is told the verdicts afterwards. "No draft" is an
empty `Draft` on the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from specdec.sampling import process_logits, sample
from specdec.speculative.acceptance import Verdict
from specdec.speculative.tree import depths


@dataclass
class Draft:
    tokens: list[int]  # [k] proposed token ids
    probs: torch.Tensor | None = None  # [k, V] draft_probs (processed) token i was drawn from; None: point masses
    parents: list[int] | None = None  # tree drafts: parent of token i (-1: the last token); None: a chain

    @property
    def depth(self) -> int:
        """The most drafted tokens one pass can accept."""
        return len(self.tokens) if self.parents is None else max(depths(self.parents), default=0)


class SequenceLike(Protocol):
    """What proposers may read of a running sequence (the engine's `Sequence`)."""

    tokens: list[int]  # prompt + output so far
    row: int  # cache row of the sequence in this batch
    params: "object"  # SamplingParams
    generator: torch.Generator
    probing: bool  # the draft is a probe after a stretch without speculation: a cheap, rough one will do


class Proposer(Protocol):
    def propose(self, seqs: Seq[SequenceLike], ks: Seq[int]) -> list[Draft]: ...

    def observe(self, seqs: Seq[SequenceLike], drafts: Seq[Draft], verdicts: Seq[Verdict], hidden=None) -> None:
        """After verification; `hidden[i]` ([kept + 1, H], for proposers with `needs_hidden`) holds the
        target's final hidden states of the tokens it committed for sequence i this step."""

    def release(self, row: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    @property
    def memory_bytes(self) -> int: ...


class StatelessProposer:
    """A proposer that keeps nothing per sequence: verdicts, row moves and releases concern it not."""

    needs_hidden = False

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    @property
    def memory_bytes(self) -> int:
        return 0


class NgramProposer(StatelessProposer):
    """Prompt lookup: continue the most recent earlier occurrence of the context's last n tokens.

    Tries n = max_n down to min_n. Example: context [1 2 3 9 1 2], n = 2 -> the suffix [1 2] occurred at
    index 0, so the draft is what followed it: [3 9 1 ...] up to k tokens. No model, no memory.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: Seq[int], k: int) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            suffix = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # earlier windows only
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs, ks):
        return [Draft(self.lookup(seq.tokens, k)) for seq, k in zip(seqs, ks)]



class DraftModelProposer:
    """A smaller model of the same family, with its own KV cache rolled back with the target's.

    The draft cache holds the K/V of a stretch of each sequence; a proposal first feeds the tokens it
    lacks (usually 1; 2 after a fully accepted draft: the last drafted token and the bonus token; more
    after a stretch without speculation, fed as one prefill), then drafts one token per pass.

    A probe (one drafted token after a stretch without speculation) would cost a prefill of everything
    the draft missed, which is what made a draft that never agrees slower than plain decoding. So a
    probe whose gap exceeds `probe_window` tokens restarts the draft's row on the last `probe_window`
    tokens only (at their true positions); `skipped[row]` counts the tokens before them. The draft then
    sees less context, which can only lower its acceptance, never change the output.
    """

    needs_hidden = False

    def __init__(self, model, max_batch_size: int, capacity: int, prefill_chunk: int = 512,
                 probe_window: int = 16) -> None:
        self.model = model
        self.cache = model.new_cache(max_batch_size, capacity)
        self.prefill_chunk = prefill_chunk
        self.probe_window = probe_window
        self.skipped: dict[int, int] = {}  # row -> leading tokens of the sequence not in the draft cache
        self._drafted_from: dict[int, int] = {}  # row -> len(seq.tokens) when this step's draft began

    def _consumed(self, row: int) -> int:
        """Tokens of the sequence in row `row` that the draft has seen (or skipped)."""
        return self.skipped.get(row, 0) + self.cache.lengths[row]

    @property
    def memory_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
        return weights + self.cache.nbytes

    def _catch_up(self, seq) -> None:
        """Feed all but the last missing tokens of `seq` (a prefill), so one or two remain to feed."""
        row, n = seq.row, len(seq.tokens)
        start = self._consumed(row)
        end = n - 1
        if seq.probing and end - start > self.probe_window:
            start = end - self.probe_window  # restart the row on the last probe_window tokens
            self.skipped[row], self.cache.lengths[row] = start, 0
        view = self.cache.row_view(row)
        while start < end:
            stop = min(end, start + self.prefill_chunk)
            chunk = torch.tensor([seq.tokens[start:stop]], device=self.model.device)
            positions = torch.arange(start, stop, device=self.model.device)[None]
            self.model(chunk, positions, view, num_logits=1)
            view.advance(0, stop - start)
            start = stop
        self.cache.lengths[row] = view.lengths[0]

    def _pick(self, seq, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's token for `seq` from logits [V]: argmax when greedy, else a seeded draw."""
        if seq.params.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits[None], seq.params)[0]
        return sample(probs, seq.generator), probs

    def propose(self, seqs, ks):
        k_max = max(ks, default=0)
        self._drafted_from = {}
        if k_max == 0:
            return [Draft([]) for _ in seqs]
        device = self.model.device
        for seq in seqs:
            if len(seq.tokens) - self._consumed(seq.row) > 2:
                self._catch_up(seq)
            self._drafted_from[seq.row] = len(seq.tokens)
        B = len(seqs)
        pending = [seq.tokens[self._consumed(seq.row):] for seq in seqs]  # 1 or 2 tokens each
        width = max(len(p) for p in pending)
        inputs = [p + [p[-1]] * (width - len(p)) for p in pending]  # right-pad; pads are never committed
        positions = [[self._consumed(s.row) + t for t in range(width)] for s in seqs]
        last = [len(p) - 1 for p in pending]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(k_max):
            logits = self.model(
                torch.tensor(inputs, device=device), torch.tensor(positions, device=device), self.cache
            )  # [B, width, V]
            for b, seq in enumerate(seqs):
                if step == 0:
                    self.cache.advance(seq.row, len(pending[b]))
                if step < ks[b]:  # a row with its ks[b] tokens rides along uncommitted (no cache growth)
                    if step > 0:
                        self.cache.advance(seq.row, 1)
                    token, p = self._pick(seq, logits[b, last[b]])
                    tokens[b].append(token)
                    if p is not None:
                        probs[b].append(p)
            if step + 1 < k_max:
                inputs = [[t[-1] if t else seq.tokens[-1]] for t, seq in zip(tokens, seqs)]
                positions = [[self._consumed(s.row)] for s in seqs]
                last = [0] * B
        return [
            Draft(tokens[b][:ks[b]], torch.stack(probs[b][:ks[b]]) if probs[b] and ks[b] else None)
            for b in range(B)
        ]

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        """Roll the draft cache back to the tokens the target kept (the drafted token fed last is kept
        only if accepted; the recovered/bonus token is fed at the next proposal)."""
        for seq, verdict in zip(seqs, verdicts):
            if seq.row not in self._drafted_from:  # the draft model did not run this step
                continue
            keep = self._drafted_from[seq.row] + verdict.num_accepted - self.skipped.get(seq.row, 0)
            self.cache.truncate(seq.row, min(keep, self.cache.lengths[seq.row]))

    def release(self, row: int) -> None:
        self.cache.lengths[row] = 0
        self.skipped.pop(row, None)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.skipped[dst] = self.skipped.pop(src, 0)
