"""Proposers: who drafts the next tokens. One small interface, batch-first.

A proposer sees the running sequences (their token ids, sampling settings, generator and cache row),
is asked for up to `ks[i]` tokens for sequence i, and is told the verdicts afterwards. "No draft" is an
empty `Draft` on the same path.
"""

from __future__ import annotations

import time
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

    request_id: str
    prompt_ids: list[int]
    tokens: list[int]  # prompt + output so far
    row: int  # cache row of the sequence in this batch
    cache_salt: str | None  # only requests with the same salt share cached state (prefixes, suffix tries)
    params: "object"  # SamplingParams
    generator: torch.Generator
    matcher: "object | None"  # GrammarMatcher: the grammar state of the committed tokens (structured output)


class Proposer(Protocol):
    def propose(self, seqs: Seq[SequenceLike], ks: Seq[int]) -> list[Draft]: ...

    def observe(self, seqs: Seq[SequenceLike], drafts: Seq[Draft], verdicts: Seq[Verdict], hidden=None) -> None:
        """After verification; `hidden[i]` ([kept + 1, H], for proposers with `needs_hidden`) holds the
        target's final hidden states of the tokens it committed for sequence i this step."""

    def release(self, row: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    @property
    def memory_bytes(self) -> int: ...

    # Proposers with K/V of their own (a draft model, EAGLE) also have `cache` (a KVCache, a row per
    # sequence), `kv_shift` (slot s of a row holds what tokens 0..s + kv_shift determine) and
    # `cached_tokens(row)`: the prefix cache keeps those K/V with the target's, and restores them.


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

    The draft cache holds the K/V of a stretch of each sequence. The engine feeds it the prompt while
    it prefills the target (`prefill`), when it expects to speculate. A proposal first feeds each row
    the tokens it lacks (usually 1; 2 after a fully accepted draft: the last drafted token and the bonus
    token; more after steps without speculation), all rows in one forward, then drafts one token per
    forward.

    A row more than `window` tokens behind (speculation was off for a while, or the engine did not feed
    it the prompt) restarts on the last `window` tokens only, at their true positions: feeding all it
    missed would cost a prefill, which is what made a draft that never agrees (probed now and then)
    slower than plain decoding. `skipped[row]` counts the tokens before them. The draft then sees less
    context, which can only lower its acceptance, never change the output.
    """

    needs_hidden = False
    kv_shift = 0  # slot s of a row holds the K/V of token s

    def __init__(self, model, max_batch_size: int, capacity: int, prefill_chunk: int = 512,
                 window: int = 16) -> None:
        self.model = model
        self.cache = model.new_cache(max_batch_size, capacity)
        self.prefill_chunk = prefill_chunk
        self.window = window
        self.skipped: dict[int, int] = {}  # row -> leading tokens of the sequence not in the draft cache
        self._drafted_from: dict[int, int] = {}  # row -> len(seq.tokens) when this step's draft began
        self.forward_seconds: float | None = None  # mean time of this step's draft forwards (catch-up excluded)
        self._sync = model.device.type == "cuda"

    def _consumed(self, row: int) -> int:
        """Tokens of the sequence in row `row` that the draft has seen (or skipped)."""
        return self.skipped.get(row, 0) + self.cache.lengths[row]

    def cached_tokens(self, row: int) -> int:
        """Leading tokens of the sequence in `row` whose K/V the draft cache holds (none after a restart)."""
        return 0 if self.skipped.get(row) else self.cache.lengths[row]

    @property
    def memory_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
        return weights + self.cache.nbytes

    def prefill(self, seq, start: int, stop: int) -> int:
        """Feed prompt tokens [start, stop) of `seq` (the chunk the target was just fed), in chunks of
        `prefill_chunk`; nothing if the row is not at `start` (it catches up at its first proposal).
        Returns how many tokens it fed."""
        row = seq.row
        if self._consumed(row) != start:
            return 0
        fed = stop - start
        view = self.cache.row_view(row)
        device = self.model.device
        while start < stop:
            end = min(stop, start + self.prefill_chunk)
            chunk = torch.tensor([seq.tokens[start:end]], device=device)
            self.model(chunk, torch.arange(start, end, device=device)[None], view, num_logits=1)
            view.advance(0, end - start)
            start = end
        self.cache.lengths[row] = view.lengths[0]
        return fed

    def _time(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pick(self, seq, logits: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft's token for `seq` from logits [V]: argmax when greedy, else a seeded draw. Under a grammar
        the logits are masked in the state after the `drafted` tokens: the draft proposes only what the
        grammar allows (its distribution, as reported for rejection sampling, is the masked one)."""
        if seq.matcher is not None:
            masks, _ = seq.matcher.masks_along(drafted)
            logits = logits.float().masked_fill(~masks[-1].to(logits.device), float("-inf"))
        if seq.params.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits[None], seq.params)[0]
        return sample(probs, seq.generator), probs

    def propose(self, seqs, ks):
        k_max = max(ks, default=0)
        self._drafted_from = {}
        self.forward_seconds = None
        if k_max == 0:
            return [Draft([]) for _ in seqs]
        device = self.model.device
        for seq in seqs:
            row, n = seq.row, len(seq.tokens)
            if n - self._consumed(row) > self.window + 1:  # restart the row on the last `window` tokens
                self.skipped[row], self.cache.lengths[row] = n - 1 - self.window, 0
            self._drafted_from[row] = n
        B = len(seqs)
        pending = [seq.tokens[self._consumed(seq.row):] for seq in seqs]  # 1 or 2 tokens each, usually
        width = max(len(p) for p in pending)
        inputs = [p + [p[-1]] * (width - len(p)) for p in pending]  # right-pad; pads are never committed
        positions = [[self._consumed(s.row) + t for t in range(width)] for s in seqs]
        last = [len(p) - 1 for p in pending]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # the cost of a drafting forward: a first forward wider than 2 tokens is a catch-up, left out
        timed_from, catch_up = (None, 1) if width > 2 else (self._time(), 0)
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
                    token, p = self._pick(seq, logits[b, last[b]], tokens[b])
                    tokens[b].append(token)
                    if p is not None:
                        probs[b].append(p)
            if timed_from is None and k_max > 1:
                timed_from = self._time()
            if step + 1 < k_max:
                inputs = [[t[-1] if t else seq.tokens[-1]] for t, seq in zip(tokens, seqs)]
                positions = [[self._consumed(s.row)] for s in seqs]
                last = [0] * B
        if k_max > catch_up:
            self.forward_seconds = (self._time() - timed_from) / (k_max - catch_up)
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
        # this step's only: the engine calls observe without propose after a step without drafting, and rows
        # change hands between steps (regression: a moved-in sequence truncated with the last occupant's length)
        self._drafted_from = {}

    def release(self, row: int) -> None:
        self.cache.lengths[row] = 0
        self.skipped.pop(row, None)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.skipped[dst] = self.skipped.pop(src, 0)


class SuffixProposer:
    """Suffix decoding: drafts from suffix tries of the request's own tokens and of past outputs
    (`specdec.speculative.suffix`). No model: a draft costs microseconds, so its price is the wider
    verification pass, which the adaptive controller weighs.

    Each sequence's trie is started at its first step (its prompt and what it has output), brought up to
    date with its new tokens at each proposal, and its output completed and kept in the global trie of its
    `cache_salt` when it leaves. A chain draft is the most frequent continuation; a tree draft (`tree`) the
    continuations best-first by their empirical probability, K nodes at most. Drafts are point masses (`Draft.probs` None):
    they are not drawn from a distribution, so rejection sampling treats them as such, which is exact.
    """

    needs_hidden = False

    def __init__(self, cache, max_spec_factor: float = 1.0, min_token_prob: float = 0.1, tree: bool = False) -> None:
        self.cache = cache  # a specdec.speculative.suffix.SuffixCache
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = tree
        self._rows: dict[int, SequenceLike] = {}  # row -> the sequence the cache knows there

    def _track(self, seq) -> None:
        """Start `seq` in the cache if new (the sequence the cache knew in its row has left), then add its new
        tokens."""
        known = self._rows.get(seq.row)
        if known is not seq:
            if known is not None:
                self._finish(known)
            self._rows[seq.row] = seq
            self.cache.stop(seq.request_id)  # (a request id reused while the cache still had it: a new request)
            self.cache.start(seq.request_id, seq.prompt_ids, seq.cache_salt)
        self._add_new_tokens(seq)

    def _add_new_tokens(self, seq) -> None:
        consumed = self.cache.consumed(seq.request_id)
        if consumed < len(seq.tokens):
            self.cache.extend(seq.request_id, seq.tokens[consumed:])

    def _finish(self, seq) -> None:
        """`seq` leaves: its whole output joins the global trie, its own trie is dropped."""
        self._add_new_tokens(seq)
        self.cache.stop(seq.request_id)

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            self._track(seq)
            if k <= 0:
                drafts.append(Draft([]))
                continue
            d = self.cache.speculate(seq.request_id, seq.tokens[-self.cache.max_depth:], k, self.max_spec_factor,
                                     self.min_token_prob, self.tree)
            drafts.append(Draft(d.tokens, parents=d.parents if self.tree and d.tokens else None))
        return drafts

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        for seq in seqs:  # known from its first step, so that its output is kept even if it never drafts
            if self._rows.get(seq.row) is not seq:
                self._track(seq)

    def release(self, row: int) -> None:
        seq = self._rows.pop(row, None)
        if seq is not None:
            self._finish(seq)

    def move_row(self, src: int, dst: int) -> None:
        self.release(dst)  # the sequence that left dst
        if src in self._rows:
            self._rows[dst] = self._rows.pop(src)

    @property
    def memory_bytes(self) -> int:
        return self.cache.memory_bytes
