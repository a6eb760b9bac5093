"""Joining the batch: a sequence's prompt fed to the target chunk by chunk, or started from the longest
cached prefix of it (`specdec.engine.prefix_cache`), and its whole blocks and tail saved for later ones.

What a joining sequence reads is all its tokens but the last, `seq.tokens[:-1]`: its prompt's, or, where it
was preempted (`Scheduler.preempt`), its prompt's and its output's so far, recomputed.

The proposer is told of each chunk (`Proposer.read_prompt`: its hidden states, for proposers on the target's
features; a draft model reads the chunk itself where that pays) and of each prefix restored or saved (its own
K/V: `Proposer.restore_prefix`, `save_prefix`).
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.target_pass import PromptRows
from specdec.engine.verification import token_logprobs
from specdec.models.kv_cache import KVCache
from specdec.speculative.controller import SpeculationController
from specdec.speculative.costs import CostModel
from specdec.speculative.proposers import Joining, PromptChunk, Proposer


class Prefill:
    """Feeds prompts into the target's cache rows (and the proposer's), through the prefix cache if any."""

    def __init__(self, cache: KVCache, proposer: Proposer, controller: SpeculationController,
                 clock: Callable[[], float], prefix_cache: PrefixCache | None, isolation: str) -> None:
        if isolation not in ("shared", "salt"):
            raise ValueError(f'prefix_isolation must be "shared" or "salt", got {isolation!r}')
        self.cache, self.proposer, self.controller = cache, proposer, controller
        self.clock = clock
        self.prefix_cache, self.isolation = prefix_cache, isolation

    def feed(self, target, seq, budget: int, batch: Joining, beside_decoding: bool = False) -> int:
        """Feed the next at most `budget` prompt tokens of `seq` to `target` (in its own row); returns how many.
        `beside_decoding`: others decode in this step, so the target's pass is also a measure of what its rows
        cost then (`CostModel.record_pass`; the proposer's reading of the prompt not counted)."""
        start = self.cache.lengths[seq.row]
        stop = min(len(seq.tokens) - 1, start + budget)
        if stop <= start:
            return 0
        t0 = self.clock()
        device = target.device
        chunk = torch.tensor([seq.tokens[start:stop]], device=device)
        wants = seq.wants_prompt_logprobs  # (all in, where it was preempted after its prompt)
        logits, hidden = target(chunk, torch.arange(start, stop, device=device)[None],
                                     self.cache.row_view(seq.row), num_logits=stop - start if wants else 1,
                                     return_hidden=True, feature_layers=self.proposer.feature_layers)
        if wants:  # position i scores prompt token i + 1, under the model's raw distribution
            seq.prompt_logprobs.extend(token_logprobs(torch.log_softmax(logits[0].float(), dim=-1),
                                                      seq.prompt_ids[start + 1:stop + 1], seq.params.prompt_logprobs))
        t1 = self.clock()
        self.controller.record_prefill("target", stop - start, t1 - t0)
        if beside_decoding:
            self.controller.costs.record_pass(stop - start, t1 - t0)
        self.read(seq, stop, hidden[0], batch, t1 - t0)
        return stop - start

    def rides(self, seq, budget: int) -> PromptRows | None:
        """The next at most `budget` prompt tokens of `seq`, to be read in the running sequences' verification
        pass (`target_pass.verify`); None when none are left to feed, or `seq` wants its prompt's log-probabilities
        (whose logits that pass does not give: it is fed on its own, `feed`)."""
        start = self.cache.lengths[seq.row]
        stop = min(len(seq.tokens) - 1, start + budget)
        if stop <= start or seq.wants_prompt_logprobs:
            return None
        return PromptRows(seq.tokens[start:stop], start)

    def read(self, seq, stop: int, hidden: torch.Tensor, batch: Joining, seconds: float) -> int:
        """`seq`'s prompt up to token `stop` is in its row's new slots (hidden [stop - start, H], the pass's
        states for them): commit them and tell the proposer; `seconds` of target time spent on them. Returns
        how many were committed."""
        start = self.cache.lengths[seq.row]
        self.cache.advance(seq.row, stop - start)
        seq.metrics.prefill_time += seconds
        self.proposer.read_prompt(PromptChunk(seq, start, stop, hidden, batch))
        return stop - start

    def caches_prefix(self, seq) -> bool:
        """Whether `seq` reads and feeds the prefix cache (with isolation "salt": only salted requests)."""
        return self.prefix_cache is not None and (self.isolation == "shared" or seq.cache_salt is not None)

    def restore(self, seq, batch: Joining) -> int:
        """Start `seq` from the longest cached prefix of its prompt but the last token: whole blocks (as far as
        the proposer can start from them), then a tail whose tokens all match, if the proposer takes tails. The
        target's K/V are copied into its row, and the proposer takes its part (a draft model's K/V, or the
        target recomputes the prefix's last token for proposers on its features). Returns how many prompt tokens
        it skips. A request with `prompt_logprobs` is never started from the cache: its prompt's logits are
        wanted (vLLM does the same).

        Example, block size 16, a 40-token prompt of which 32 are cached in blocks and a tail of 5 more: plain
        decoding and draft models prefill tokens 37..38 (a draft model reads 32..36 itself); Medusa 36..38.
        """
        if seq.wants_prompt_logprobs:
            return 0
        t0 = self.clock()
        try:
            return self._restore(seq, batch)
        finally:
            seq.metrics.restore_time += self.clock() - t0

    def _restore(self, seq, batch: Joining) -> int:
        pc, row, tokens = self.prefix_cache, seq.row, seq.tokens[:-1]
        keys = pc.keys(tokens, seq.cache_salt)
        found = pc.lookup(keys)
        chain = found[:self.proposer.usable_prefix(pc, found)]
        tail, pc.tail_from_disk = None, False
        if len(chain) == len(found) and self.proposer.usable_tail:
            tail = pc.tail("target", keys[:len(chain)], tokens[len(chain) * pc.block_size:], seq.cache_salt)
        if not chain and tail is None:
            return 0
        restored = pc.load("target", chain, self.cache, row, tail=tail)
        cached = self.proposer.restore_prefix(seq, pc, chain, restored, batch)
        self.cache.truncate(row, cached)
        if seq.num_output == 0:  # (not its own tokens, found again where it was preempted)
            seq.metrics.cached_tokens = cached
            ram = (len(found) - pc.from_disk) * pc.block_size  # (the disk's blocks end the chain)
            on_disk = cached if pc.tail_from_disk else min(cached, len(chain) * pc.block_size)
            seq.metrics.disk_cached_tokens = max(0, on_disk - ram)
        return cached

    def save(self, seq) -> None:
        """Save the tokens of `seq` that its row holds: the target's whole blocks and tail, and the proposer's
        whole blocks as far as they go."""
        pc, row = self.prefix_cache, seq.row
        tokens = seq.tokens[:self.cache.lengths[row]]  # (it may hold tokens past a stop)
        keys = pc.keys(tokens, seq.cache_salt, tail=True)
        whole = len(tokens) // pc.block_size
        pc.save("target", keys, self.cache, row, tail=len(tokens) - whole * pc.block_size)
        self.proposer.save_prefix(seq, pc, keys[:whole])


def ride_pays(costs: CostModel, batch_size: int, tokens: int) -> bool:
    """Whether `tokens` prompt tokens of a joining sequence cost less riding in the pass of `batch_size`
    decoding sequences, whose rows are then padded to as many tokens, than read in a pass of their own, which
    reads the weights once more: t((B + 1) x tokens rows) <= t(tokens) + t(B) on the target's measured pass
    costs (`CostModel.pass_time`), drafts not counted; yes until those are measured. For a pass of a + b x rows:
    riding pays while b x B x (tokens - 1) <= a. Measured on a 2-core Zen 1 (a ~ 50 ms, b ~ 53 ms a row): 6
    running rows padded to 8 rode in 2.8 s, where 8 rows of their own and then the 6 rows took ~0.8 s; where a
    row costs ~0.1 of a one-row pass, one running sequence lets ~11 tokens ride."""
    ride, alone, decode = costs.pass_time((batch_size + 1) * tokens), costs.pass_time(tokens), costs.pass_time(batch_size)
    return ride is None or alone is None or decode is None or ride <= alone + decode


class ChunkBudget:
    """How many prompt tokens a joining sequence reads in each step while others decode (its rows riding in
    their verification pass): as many as keep a step within `factor` times a decode step alone, by
    measurement, so that a long prompt does not stall the running streams (a 512-token chunk at a depth of
    8k tokens takes seconds on a CPU).

    A step reading n tokens is modelled as `decode + n x per_token`: `decode` (seconds, per batch size) is
    measured on steps that read no prompt, `per_token` on those that do (their time beyond `decode`, per
    token read; it grows with the prompt's depth, which moves little from one step to the next), both as
    moving averages. The budget is (factor - 1) x decode / per_token tokens, at least 1 (the prompt always
    advances) and at most `most`; `first` until both are measured.

    Example: factor 2, decode steps of 80 ms, a step that read 8 tokens took 240 ms -> 20 ms a token -> the
    next step reads (2 - 1) x 80 / 20 = 4 tokens.
    """

    def __init__(self, factor: float, most: int, first: int = 8, weight: float = 0.3) -> None:
        if factor <= 1:
            raise ValueError(f"a step may take factor > 1 times a decode step, got {factor}")
        self.factor, self.most, self.first, self.weight = factor, most, min(first, most), weight
        self.decode: dict[int, float] = {}  # batch size -> seconds of a step that reads no prompt
        self.per_token: float | None = None

    def tokens(self, batch_size: int) -> int:
        decode = self._decode(batch_size)
        if decode is None or self.per_token is None:
            return self.first
        if self.per_token <= 0:  # (a clock that does not move)
            return self.most
        return max(1, min(self.most, int((self.factor - 1) * decode / self.per_token)))

    def record(self, batch_size: int, seconds: float, read: int) -> None:
        """A step of `batch_size` decoding sequences took `seconds`, reading `read` prompt tokens beside them."""
        if read == 0:
            old = self.decode.get(batch_size)
            self.decode[batch_size] = seconds if old is None else old + self.weight * (seconds - old)
            return
        decode = self._decode(batch_size)
        if decode is None:
            return
        per_token = max(seconds - decode, 1e-3 * decode) / read
        self.per_token = per_token if self.per_token is None else self.per_token + self.weight * (per_token - self.per_token)

    def _decode(self, batch_size: int) -> float | None:
        if not self.decode:
            return None
        return self.decode[min(self.decode, key=lambda b: (abs(b - batch_size), b))]
