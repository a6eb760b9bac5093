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

    def preempt(self, seq) -> None:
        """`seq` leaves the batch to join again later, all its tokens so far read as its prompt (its rows are
        freed; see `Scheduler.preempt`): forget what came of its rows (by default as when it leaves for good)."""
        self.release(seq)
        seq.draft_state = None

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
            self.suffix_cache.start(seq.request_id, seq.tokens[:chunk.stop], seq.cache_salt)
            return
        consumed = self.suffix_cache.consumed(seq.request_id)
        if consumed < chunk.stop:
            self.suffix_cache.extend_prompt(seq.request_id, seq.tokens[consumed:chunk.stop])

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

    def preempt(self, seq) -> None:
        """Its trie is no cache row: kept, up to date, so that reading its tokens again adds nothing to it."""
        if self._started.get(seq.request_id) is seq:
            self._track(seq)

    def release(self, seq) -> None:
        if self._started.get(seq.request_id) is seq:
            self._track(seq)  # its last tokens
            self.suffix_cache.stop(seq.request_id)
            del self._started[seq.request_id]

    @property
    def memory_bytes(self) -> int:
        return self.suffix_cache.memory_bytes
