"""Proposers: who drafts the next tokens. One interface (`Proposer`), batch-first.

A proposer sees the running sequences (their token ids, sampling settings, generator and cache row),
is asked for up to `ks[i]` tokens for sequence i, and is told the verdicts afterwards. "No draft" is an
empty `Draft` on the same path, and no speculation at all is the `NullProposer`.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np
import torch

from specdec.models.kv_cache import KVCache
from specdec.sampling import process_logits, sample
from specdec.speculative.acceptance import Verdict
from specdec.speculative.costs import default_clock
from specdec.speculative.tree import depths


@dataclass
class Draft:
    tokens: list[int]  # [k] proposed token ids
    probs: torch.Tensor | None = None  # [k, V] draft_probs (processed) token i was drawn from; None: point masses
    parents: list[int] | None = None  # tree drafts: parent of token i (-1: the last token); None: a chain
    kinds: list[int] | None = None  # chains: what kind of guess token i is (`Proposer.guess_kinds`); None: unlabelled
    source: str | None = None  # which drafter made it, where several take turns (`AutoProposer`): "suffix", ...

    @property
    def depth(self) -> int:
        """The most drafted tokens one pass can accept."""
        return len(self.tokens) if self.parents is None else max(depths(self.parents), default=0)


@dataclass
class Proposal:
    """What a proposer returns for a step: one draft per sequence, and what one drafting forward cost."""

    drafts: list[Draft]
    forward_seconds: float | None = None  # mean time of one drafting forward (catch-up left out); None: unmeasured


@dataclass
class Joining:
    """The batch a sequence joins, as a proposer deciding whether to read its prompt sees it."""

    running: Seq  # the running sequences
    batch_size: int  # the batch it will be in: the running ones, it, and those waiting behind it (at most the max)


@dataclass
class PromptChunk:
    """Prompt tokens [start, stop) of `seq`, just prefilled by the target."""

    seq: Any
    start: int
    stop: int
    hidden: torch.Tensor  # [stop - start, F] the target's final hidden states of those tokens (F = H, or more
    # with `Proposer.feature_layers`)
    batch: Joining


class Proposer:
    """Who drafts the next tokens: everything the engine asks of it, with the defaults of a proposer that has
    nothing to do there, so that the engine asks every proposer the same things and never which one it has.
    Batch-first: `seqs` are the running sequences (the engine's `Sequence`: token ids, sampling settings,
    generator, grammar state, cache row, metrics), `ks[i]` the tokens wanted for sequence i.

    Per-sequence state lives on the sequence (`seq.draft_state`, the proposer's to set), so it follows the
    sequence wherever its row moves and goes when it goes. K/V of its own (a draft model, EAGLE) are in
    `cache`, a row per sequence as in the target's cache: the engine moves, resizes and frees the rows of its
    `kv_caches` with the target's, and the prefix cache keeps them (`save_prefix`, `restore_prefix`).
    It reads the target's final hidden states where it wants them: the engine hands them to every proposer
    (`read_prompt`'s chunk, `observe`'s `hidden`). Its times are taken with its controller's clock (`bind`).
    """

    cache: KVCache | None = None  # K/V of its own
    kv_shift = 0  # slot s of a `cache` row holds what tokens 0..s + kv_shift determine
    # what the controller asks of it (`SpeculationController.for_proposer`): what a row re-reads when drafting
    # resumes after a pause (a draft model's window), and > 0 where its chain drafts label each token with one
    # of this many kinds of guess (`Draft.kinds`), tokens of one kind being accepted at about one rate (the
    # adaptive controller learns each kind's rate and cuts drafts where their tokens stop paying, `ByKind`)
    restart_tokens = 0
    guess_kinds = 0
    # the target layers whose outputs it reads beside the final hidden states (EAGLE-3 heads fuse low, middle
    # and high layers): the engine asks every pass for them, `hidden` then being [T, (len + 1) * H]
    feature_layers: tuple[int, ...] = ()
    controller = None  # the `SpeculationController` that runs it (`bind`)

    def max_width(self, k: int) -> int:
        """The most tokens (tree nodes) one draft holds when asked for k: k for chains, 0 if it never drafts."""
        return k

    def bind(self, controller) -> None:
        """The `SpeculationController` that runs it: its clock, and its costs for a proposer that chooses its
        own drafts or whether to read a prompt."""
        self.controller = controller

    def clock(self) -> float:
        """The time, as the engine takes it (its controller's clock)."""
        return default_clock() if self.controller is None else self.controller.clock()

    @property
    def kv_caches(self) -> dict[str, KVCache]:
        """Its own K/V caches by name ("draft"), rows kept with the target's (none: {})."""
        return {} if self.cache is None else {"draft": self.cache}

    def propose(self, seqs: Seq, ks: Seq[int]) -> Proposal:
        """Drafts for this step, timed as a whole: one forward per drafted token."""
        k_max = max(ks, default=0)
        if k_max == 0:
            return Proposal([Draft([]) for _ in seqs])
        t0 = self.clock()
        drafts = self.draft(seqs, ks)
        return Proposal(drafts, (self.clock() - t0) / k_max)

    def draft(self, seqs: Seq, ks: Seq[int]) -> list[Draft]:
        raise NotImplementedError

    def prefill(self, seq, start: int, stop: int) -> int:
        """Read prompt tokens [start, stop) of `seq` into its own cache; returns how many it read."""
        return 0

    def read_prompt(self, chunk: PromptChunk) -> None:
        """The target has just prefilled `chunk` of a joining sequence's prompt (its hidden states given)."""

    def usable_prefix(self, prefix, chain: list) -> int:
        """How many blocks of a cached prompt prefix `chain` (`PrefixCache.lookup`) a sequence may start from."""
        return len(chain)

    @property
    def usable_tail(self) -> bool:
        """Whether a sequence may start from a cached tail after the blocks (the target's K/V only: what the
        proposer needs of its tokens it computes, as of any token not cached)."""
        return True

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        """`seq` starts from `chain`, of which the target's cache row now holds `cached` tokens: take what it
        keeps of them; returns how many of them the target keeps (fewer: it recomputes the rest)."""
        return cached

    def save_prefix(self, seq, prefix, keys: list[bytes]) -> None:
        """Save the whole blocks (`keys`) of `seq` that its own cache row holds to `prefix` (a `PrefixCache`)."""
        if self.cache is not None:
            drafted = self.cached_tokens(seq) // prefix.block_size
            prefix.save("draft", keys[:drafted], self.cache, seq.row, self.kv_shift)

    def observe(self, seqs: Seq, drafts: Seq[Draft], verdicts: Seq[Verdict],
                hidden: Seq[torch.Tensor] | None = None) -> None:
        """After verification; `hidden[i]` ([kept + 1, H]) holds the target's final hidden states of the tokens
        it committed for sequence i this step (the engine always gives them)."""

    def release(self, seq) -> None:
        """`seq` leaves the batch (its `cache` row is freed by the engine)."""

    def cached_tokens(self, seq) -> int:
        """Leading tokens of `seq` whose K/V its `cache` row holds."""
        return 0

    @property
    def memory_bytes(self) -> int:
        return 0


class NullProposer(Proposer):
    """No speculation: never drafts."""

    def max_width(self, k: int) -> int:
        return 0

    def propose(self, seqs, ks) -> Proposal:
        return Proposal([Draft([]) for _ in seqs])


class NgramProposer(Proposer):
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

    def draft(self, seqs, ks):
        return [Draft(self.lookup(seq.tokens, k)) for seq, k in zip(seqs, ks)]


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
                                              len(seq.prompt_ids) - 1 - start, seq.params.max_tokens)
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


class SuffixProposer(Proposer):
    """Suffix decoding: drafts from suffix tries of the request's own tokens and of past outputs
    (`specdec.speculative.suffix`). No model: a draft costs microseconds, so its price is the wider
    verification pass, which the adaptive controller weighs.

    Each sequence's trie is built as the target reads its prompt, chunk by chunk (`read_prompt`: a 30k-token
    prompt's trie takes seconds to build, spread over the chunks rather than stalling its first step), or
    at its first step where no chunk was read (a whole prompt from the prefix cache), and brought up to date
    with its new tokens at each proposal; when it leaves, its whole output joins the global trie of its
    `cache_salt` (the cache knows sequences by `request_id`; `_started` holds those it started). A chain
    draft is the most frequent continuation; a tree draft (`tree`) the continuations best-first by their
    empirical probability, K nodes at most. Drafts are point masses (`Draft.probs` None): they are not drawn
    from a distribution, so rejection sampling treats them as such, which is exact.
    """

    # kinds of guess (chains): how sure the trie is of the token given the ones before it (its count among
    # its siblings': under 0.5, 0.8, 0.99, or alone) x how long a context it continues (the match plus the
    # tokens drafted before it: 1, 2-3, 4-7, 8-15, 16+). Measured on code edits and HumanEval: a token alone
    # after a 16-token context was accepted 97% of the time, one after a single matched token 18-34%.
    SURENESS = (0.5, 0.8, 0.99)
    CONTEXT = (2, 4, 8, 16)

    def __init__(self, cache, max_spec_factor: float = 1.0, min_token_prob: float = 0.1, tree: bool = False) -> None:
        self.suffix_cache = cache  # a specdec.speculative.suffix.SuffixCache
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = tree
        self.guess_kinds = 0 if tree else (len(self.SURENESS) + 1) * (len(self.CONTEXT) + 1)
        self._started: dict[str, object] = {}  # request id -> the sequence the cache holds it for

    @classmethod
    def kinds_of(cls, probs: list[float], match_len: int) -> list[int]:
        """The kind of each token of a chain draft with path probabilities `probs` after `match_len` matched
        context tokens. Example: probs [1.0, 0.6], match 3 -> [alone after 3, 0.6 after 4] = [3 * 5 + 1, 1 * 5 + 2]."""
        kinds, before = [], 1.0
        for i, p in enumerate(probs):
            sure = bisect_right(cls.SURENESS, p / before)
            kinds.append(sure * (len(cls.CONTEXT) + 1) + bisect_right(cls.CONTEXT, match_len + i))
            before = p
        return kinds

    def _track(self, seq) -> None:
        """Start `seq` in the cache at its first step, then add its new tokens."""
        if self._started.get(seq.request_id) is not seq:
            self._started[seq.request_id] = seq
            self.suffix_cache.stop(seq.request_id)  # (a request id reused while the cache had it: a new request)
            self.suffix_cache.start(seq.request_id, seq.prompt_ids, seq.cache_salt)
        consumed = self.suffix_cache.consumed(seq.request_id)
        if consumed < len(seq.prompt_ids):  # (the prompt's end, where no chunk read it)
            self.suffix_cache.extend_prompt(seq.request_id, seq.prompt_ids[consumed:])
            consumed = len(seq.prompt_ids)
        if consumed < len(seq.tokens):
            self.suffix_cache.extend(seq.request_id, seq.tokens[consumed:])

    def read_prompt(self, chunk: PromptChunk) -> None:
        """Add the prompt up to the chunk's end to the sequence's trie (from its start, at its first chunk: a
        cached prefix before it included)."""
        seq = chunk.seq
        if self._started.get(seq.request_id) is not seq:
            self._started[seq.request_id] = seq
            self.suffix_cache.stop(seq.request_id)
            self.suffix_cache.start(seq.request_id, seq.prompt_ids[:chunk.stop], seq.cache_salt)
            return
        consumed = self.suffix_cache.consumed(seq.request_id)
        if consumed < chunk.stop:
            self.suffix_cache.extend_prompt(seq.request_id, seq.prompt_ids[consumed:chunk.stop])

    def draft(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            self._track(seq)
            d = self.suffix_cache.speculate(seq.request_id, seq.tokens[-self.suffix_cache.max_depth:], k,
                                            self.max_spec_factor, self.min_token_prob, self.tree)
            if self.tree:
                drafts.append(Draft(d.tokens, parents=d.parents if d.tokens else None))
            else:
                drafts.append(Draft(d.tokens, kinds=self.kinds_of(d.probs, d.match_len)))
        return drafts

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        for seq in seqs:  # known from its first step, so that its output is kept even if it never drafts
            if self._started.get(seq.request_id) is not seq:
                self._track(seq)

    def release(self, seq) -> None:
        if self._started.get(seq.request_id) is seq:
            self._track(seq)  # its last tokens
            self.suffix_cache.stop(seq.request_id)
            del self._started[seq.request_id]

    @property
    def memory_bytes(self) -> int:
        return self.suffix_cache.memory_bytes
