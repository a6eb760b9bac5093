"""The engine: prefill, then propose -> verify -> accept -> commit -> observe, for a batch of sequences.

It works on token ids; the tokenizer is used only for stop strings and streamed text. Who runs in which
cache row is the scheduler's (`scheduler`: rows 0..B-1 packed, one sequence joining at a time through
chunked prefill, `prefill_chunk` prompt tokens per step at most); feeding a joining prompt (and the prefix
cache) is `prefill`'s; how many tokens to draft is the controller's (`SpeculationController`); what a
sequence's text is and where it stops is its `OutputText`'s; judging one sequence's rows is
`verification`'s; the target pass is `target_pass`'s. The engine runs the step:

    ks = controller.choose(...)                 # K for each running sequence
    proposal = proposer.propose(running, ks)    # drafts
    drafts = controller.cut(proposal.drafts, ...)  # (labelled drafts: cut where their tokens stop paying)
    logits, hidden = target([last, *draft] per row)  # one pass for the batch
    per sequence: verification.accept -> KVCache.commit -> OutputText.append -> output
    proposer.observe(..., hidden); controller.report(...)

It asks every proposer the same things (`Proposer`) and never which one it has. Invariant: the target cache
holds every token of a sequence but the last; a step feeds `[last, *draft]` (T = K + 1 tokens) and commits
`1 + accepted` of them. Plain decoding is the same step with an empty draft (the `NullProposer` never
drafts). A tree draft is verified in the same pass with a tree mask, and its accepted path is gathered into
place (`KVCache.commit`).

A failure is contained to the sequence it concerns: an exception in a sequence's own part of a step
(prefilling it, judging its draft, appending, detokenizing, advancing its grammar) ends that sequence
alone, with finish_reason "abort" and `RequestOutput.error`, while the rest of the batch goes on as if it
had never been there. A draft the target pass cannot take (ids outside the vocabulary) is replaced by an
empty one. Only the shared target pass and the proposer, where no one sequence can be blamed, fail the
whole step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.config import SamplingParams
from specdec.engine import verification
from specdec.engine.disk_cache import DiskTier
from specdec.engine.metrics import SpecMetrics
from specdec.engine.output_text import OutputText
from specdec.engine.outputs import RequestOutput
from specdec.engine.prefill import ChunkBudget, Prefill, ride_pays
from specdec.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence, request_grammar
from specdec.engine.target_pass import PromptRows, verifiable, verify
from specdec.models.kv_cache import PAGE, KVCache
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import make_generator
from specdec.speculative.acceptance import Verdict
from specdec.speculative.controller import SpeculationController, StepReport
from specdec.speculative.proposers import Draft, Joining, NullProposer, Proposer

logger = logging.getLogger(__name__)


@dataclass
class Riding:
    """A joining sequence's next prompt tokens, read in the running sequences' verification pass."""

    seq: Sequence
    rows: PromptRows
    batch: Joining  # what the proposer is told of the batch it joins
    hidden: torch.Tensor | None = None  # [len(rows.tokens), F] the pass's states for the rows
    seconds: float = 0.0  # the pass's time spent on them (their share of its rows)


class Engine:
    def __init__(
        self,
        target,
        tokenizer: Tokenizer,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        adaptive: bool = False,
        max_model_len: int = 4096,
        max_batch_size: int = 1,
        prefill_chunk: int = 512,
        prefill_itl_factor: float | None = 2.0,
        disable_by_batch_size: int | None = None,
        prefix_cache_blocks: int = 0,
        prefix_block_size: int = BLOCK_SIZE,
        prefix_isolation: str = "shared",
        prefix_disk: DiskTier | None = None,
        row_tokens: int | None = None,
        controller: SpeculationController | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`controller`: the speculation policy (default: from `num_speculative_tokens`, `adaptive` and
        `disable_by_batch_size`); `prefix_isolation`: "shared" (vLLM's: requests without a `cache_salt` share
        cached prefixes with each other) or "salt" (only salted requests use the prefix cache, each salt its
        own: how much of a prompt was cached tells nothing of another tenant's prompts); `prefix_disk`: the prefix
        cache's disk tier (`disk_cache.DiskTier`), or None; `row_tokens`: the K/V
        slots all running sequences share, in pages (default: `max_batch_size` sequences of `max_model_len`;
        fewer: sequences run while their lengths fit it, see `Scheduler`); `clock`:
        what every part of a step is timed with, by the controller and the proposer too (default: the
        controller's, perf_counter after a GPU's queued work); `prefill_itl_factor`: while sequences decode, a
        joining prompt is read inside their steps, as many tokens a step as keep it within this factor of a
        decode step alone (`ChunkBudget`); None: in chunks of `prefill_chunk` of its own, each stalling them."""
        self.target = target
        self.vocab_size = target.config.vocab_size  # the width of its logits
        self.tokenizer = tokenizer
        self.proposer = proposer or NullProposer()
        self.max_model_len = max_model_len
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk  # prompt tokens fed per step, at most
        self.chunk_budget = ChunkBudget(prefill_itl_factor, prefill_chunk) if prefill_itl_factor else None
        self._fed = [0, 0.0]  # (`step`)
        if controller is None:
            controller = SpeculationController.for_proposer(self.proposer, num_speculative_tokens, adaptive,
                                                            disable_by_batch_size, clock)
        else:
            self.proposer.bind(controller)
        self.controller = controller
        self._now = controller.clock
        # + the widest draft: a row near the end of the context is padded to the batch's widest (never committed)
        self.widest = widest = self.proposer.max_width(num_speculative_tokens)
        # caches whose prefix-cache blocks are pages of their own pools (see `PrefixCache`)
        mapped = () if prefix_cache_blocks <= 0 or prefix_block_size != PAGE else \
            ("target", *(name for name in self.proposer.kv_caches if self.proposer.kv_shift == 0))
        self.cache = self._new_cache(max_batch_size, row_tokens, widest, prefix_cache_blocks, mapped)
        caches = {"target": self.cache, **self.proposer.kv_caches}
        self.scheduler = Scheduler(max_batch_size, list(caches.values()),
                                   need=lambda seq: len(seq.tokens) + widest,
                                   shared=self._shared_pages, pinned=self._pinned_pages)
        self._caches = caches
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.metrics = SpecMetrics()  # cumulative
        self._aborted: set[str] = set()
        self._failed: list[Sequence] = []  # failed in this step (`_isolated`), reported at its end
        self.prefix_cache = PrefixCache(caches, prefix_cache_blocks, prefix_block_size, mapped, prefix_disk) \
            if prefix_cache_blocks > 0 else None
        self.prefill = Prefill(self.cache, self.proposer, controller, self._now, self.prefix_cache, prefix_isolation)

    def _shared_pages(self, cache: KVCache, seq: Sequence) -> int:
        """Whole pages of `seq`'s row of `cache` that the prefix cache holds (`Scheduler`: its memory, not the
        row's; the row writes only past its length, so it never copies them)."""
        if self.prefix_cache is None or not self.prefix_cache.mapped:
            return 0
        name = next(name for name, c in self._caches.items() if c is cache)
        return self.prefix_cache.shared(name, cache.pages[seq.row][:cache.lengths[seq.row] // PAGE])

    def _pinned_pages(self, cache: KVCache) -> int:
        """The prefix cache's pages of `cache` that rows hold (`Scheduler`)."""
        if self.prefix_cache is None or not self.prefix_cache.mapped:
            return 0
        return self.prefix_cache.pinned(next(name for name, c in self._caches.items() if c is cache))

    def _new_cache(self, max_batch_size: int, row_tokens: int | None, widest: int, prefix_pages: int = 0,
                   mapped: tuple[str, ...] = ()) -> KVCache:
        """The target's cache: `max_batch_size` rows of up to max_model_len + `widest` slots, paged, its pool
        `row_tokens` slots (+ each row's widest draft and a page of rounding); and the proposer's own caches
        alike, their rows as long as they need (+ what they keep beyond max_model_len + widest). A cache named
        in `mapped` has `prefix_pages` more pages, set aside for the prefix cache's blocks."""
        row_tokens = max_batch_size * self.max_model_len if row_tokens is None else row_tokens
        if row_tokens < self.max_model_len:
            raise ValueError(f"row_tokens {row_tokens} cannot hold one sequence of max_model_len {self.max_model_len}")
        capacity = self.max_model_len + widest
        pages = KVCache.pages_for(row_tokens) + max_batch_size * (KVCache.pages_for(widest) + 1)
        extra = prefix_pages if "target" in mapped else 0
        cache = self.target.new_cache(max_batch_size, capacity, num_pages=pages + extra)
        cache.prefix_pages = extra
        for name, own in self.proposer.kv_caches.items():
            margin = max(0, own.capacity - self.max_model_len - widest)
            extra = prefix_pages if name in mapped else 0
            own.reshape(max_batch_size, cache.capacity + margin,
                        num_pages=pages + max_batch_size * (KVCache.pages_for(margin) + 1) + extra)
            own.prefix_pages = extra
        return cache

    # the scheduler's queue and batch, the prefix cache's isolation, and the controller's costs, seen from outside
    max_batch_size = property(lambda self: self.scheduler.max_batch_size)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    prefilling = property(lambda self: self.scheduler.prefilling)
    prefix_isolation = property(lambda self: self.prefill.isolation)
    costs = property(lambda self: self.controller.costs)

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        grammar = request_grammar(prompt_token_ids, params, self.tokenizer, self.vocab_size, self.max_model_len)
        seq = Sequence(request_id=request_id, prompt_ids=list(prompt_token_ids), params=params,
                       generator=make_generator(params.seed), output=OutputText(self.tokenizer, params, self.eos_ids),
                       tokens=list(prompt_token_ids), start_time=self._now(), estimate=self.controller.new_estimate(),
                       logprobs=[] if params.logprobs is not None else None,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       matcher=grammar.matcher() if grammar is not None else None, cache_salt=cache_salt)
        seq.metrics.prompt_tokens = len(prompt_token_ids)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def num_queued(self) -> int:
        """Waiting requests that the next step cannot start (see `Scheduler.num_queued`)."""
        return self.scheduler.num_queued()

    # ----------------------------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs = self._drop_aborted()
        while (seq := self.scheduler.victim()) is not None:  # the batch outgrew the pools: the newest steps out
            self._preempt(seq)
        self._fed = [0, 0.0]  # prompt tokens read in a pass of their own while others decode, and its seconds
        riding = self._prefill()
        if self.running:
            outputs += self._decode(self.running, riding)
        if riding is not None:
            self._rode(riding)
            for seq in self.running:  # the pads' pages: the rows were as wide as the prompt chunk
                self.cache.trim(seq.row, len(seq.tokens) + self.widest)
        outputs += [seq.report([]) for seq in self._failed]
        self._failed.clear()
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._release(seq)
        return outputs

    def _decode(self, seqs: list[Sequence], riding: Riding | None = None) -> list[RequestOutput]:
        """Propose, verify (one target pass for the batch, `riding`'s prompt rows in it if any), then for each
        sequence on its own: judge and commit, append and report. A sequence whose own part raises is left out
        of what follows."""
        ks = self.controller.choose([s.estimate for s in seqs], [s.params.max_tokens - s.num_output for s in seqs],
                                    [self.max_model_len - len(s.tokens) for s in seqs], [len(s.tokens) for s in seqs])
        t0 = self._now()
        proposal = self.proposer.propose(seqs, ks)
        drafts = self.controller.cut([verifiable(seq, d, self.vocab_size) for seq, d in zip(seqs, proposal.drafts)],
                                     [s.estimate for s in seqs])
        t1 = self._now()
        target_logits, hidden = verify(self.target, self.cache, seqs, drafts, self.proposer.feature_layers,
                                       riding and riding.rows)  # [B, T, V], [B (+ 1 riding), T, F]
        t2 = self._now()
        read = 0 if riding is None else len(riding.rows.tokens)
        if riding is not None:  # its share of the pass's time, by rows
            riding.hidden = hidden[len(seqs), :read]
            riding.seconds = (t2 - t1) * read / (read + sum(1 + len(d.tokens) for d in drafts))
        judged = [self._isolated(seq, self._judge, seq, draft, target_logits[b])
                  for b, (seq, draft) in enumerate(zip(seqs, drafts))]
        live = [b for b, j in enumerate(judged) if j is not None]
        self.proposer.observe([seqs[b] for b in live], [drafts[b] for b in live], [judged[b][0] for b in live],
                              [hidden[b, judged[b][2]] for b in live])
        times = ((t1 - t0) / len(seqs), (t2 - t1) / len(seqs))
        emitted = [self._isolated(seqs[b], self._emit, seqs[b], drafts[b], *judged[b], times) for b in live]
        done = [b for b, out in zip(live, emitted) if out is not None]
        if self.chunk_budget is not None:  # (a prompt read in a pass of its own counts as if it rode)
            self.chunk_budget.record(len(seqs), self._now() - t0 + self._fed[1], read + self._fed[0])
        width = 1 + max(len(d.tokens) for d in drafts)  # each running row's, in the pass
        self.controller.report(StepReport(
            batch_size=len(seqs), k=max(ks), forward_seconds=proposal.forward_seconds,
            rows=len(seqs) * width, verify_seconds=None if read else t2 - t1,
            outcomes=[(seqs[b].estimate, drafts[b].depth, judged[b][0].num_accepted) for b in done],
            kinds=[(seqs[b].estimate, drafts[b].kinds, judged[b][0].num_accepted) for b in done if drafts[b].kinds],
            # (the rows it computed: the running ones padded to the prompt's chunk, and the prompt's)
            ride=((len(seqs) + 1) * max(read, width), t2 - t1) if read else None))
        return [out for out in emitted if out is not None]

    def _judge(self, seq: Sequence, draft: Draft, target_logits: torch.Tensor
               ) -> tuple[Verdict, torch.Tensor | None, list[int]]:
        """Accept or reject `draft` (target_logits [T, V]) and commit the kept slots of the pass: the verdict,
        the log-probabilities of its rows (see `verification.accept`), and the pass rows `[last, *kept]`
        committed, which scored the emitted tokens."""
        verdict, logprobs = verification.accept(seq, draft, target_logits)
        slots = [0] + [1 + i for i in verdict.kept()]
        self.cache.commit(seq.row, slots)
        return verdict, logprobs, slots

    def _emit(self, seq: Sequence, draft: Draft, verdict: Verdict, logprobs: torch.Tensor | None, rows: list[int],
              times: tuple[float, float]) -> RequestOutput:
        """Append the verdict's tokens to `seq` (stop rules applied), record them, and report its output."""
        new_ids = seq.output.append(verdict.output_tokens(draft.tokens))
        seq.tokens += new_ids
        if seq.matcher is not None:
            seq.matcher.advance(new_ids)
        if logprobs is not None:
            seq.record_logprobs(logprobs[rows[:len(new_ids)]], new_ids)
        seq.metrics.record_step(draft.depth, verdict.num_accepted, len(new_ids), draft.source)
        seq.metrics.draft_time += times[0]
        seq.metrics.target_time += times[1]
        return seq.report(new_ids)

    def _isolated(self, seq: Sequence, fn, *args):
        """`fn(*args)`, a part of the step that concerns `seq` alone; None if it raised: then `seq` fails
        (finish_reason "abort", `error` set; reported and released at the end of the step) and the others
        go on. Example: a NaN in one sequence's probabilities makes its draw raise; only it ends."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed in the engine; the other requests go on", seq.request_id)
            seq.output.abort()
            seq.error = f"{type(e).__name__}: {e}"
            self._failed.append(seq)
            return None

    # ----------------------------------------------------------------------------------- joining
    def _prefill(self) -> Riding | None:
        """Feed joining sequences up to `prefill_chunk` prompt tokens in all (see `Prefill`), so that a long
        prompt delays the running sequences' step by one chunk at most. Once all its prompt tokens but the
        last are in the cache a sequence joins the batch (and decodes in this step), and the next waiting one
        takes the rest of the budget. While sequences run (with `chunk_budget`), the joining one reads only as
        many tokens as the budget allows, and they are returned to ride in the running ones' verification pass
        (read by `_rode`) where that costs less than a pass of their own before it (`_ride_pays`); prompts
        that arrive together while none decode are still fed together, and start decoding in the same step.

        Example, prefill_chunk 4, prompts of 10 and 3 tokens waiting (9 and 2 to feed): step 1 feeds tokens
        0..3 of the first, step 2 tokens 4..7, step 3 token 8 (the first joins) and tokens 0..1 of the second
        (it joins too). With a chunk budget of 2 or more, the second's 2 tokens ride in the first's pass of
        step 4 instead, and it decodes from step 5.
        """
        budget, prefill = self.prefill_chunk, self.prefill
        decoding = bool(self.running)  # (those joining in this step have no stream to stall yet)
        while True:
            started = self.scheduler.prefilling is None
            seq = self.scheduler.joining()
            if seq is None:
                return None
            batch = Joining(self.running, min(self.max_batch_size, len(self.running) + 1 + len(self.waiting)))
            if started and prefill.caches_prefix(seq) and self._isolated(seq, prefill.restore, seq, batch) is None:
                self._release(seq)
                continue
            if decoding and self.chunk_budget is not None:  # (room: the running rows are padded as wide)
                room = self.cache.capacity - max(self.cache.lengths[s.row] for s in self.running)
                most = min(budget, room, self.chunk_budget.tokens(len(self.running)))
                if self._ride_pays(most):
                    rows = prefill.rides(seq, self.scheduler.widest_ride(most, self.widest + 1))
                    if rows is not None:
                        return Riding(seq, rows, batch)
                elif not seq.wants_prompt_logprobs:  # (those are fed a chunk at a time, as ever)
                    budget = min(budget, most)
            t0 = self._now()
            fed = self._isolated(seq, prefill.feed, self.target, seq, budget, batch, decoding)
            if fed is None:
                self._release(seq)
                continue
            if decoding and fed:  # (the step's time for the chunk budget: the proposer's reading included)
                self._fed[0] += fed
                self._fed[1] += self._now() - t0
            budget -= fed
            if self.cache.lengths[seq.row] < len(seq.tokens) - 1:
                return  # the budget is spent
            self.scheduler.join(seq)
            if prefill.caches_prefix(seq):  # sequences joining later may share its prompt already
                prefill.save(seq)

    def _ride_pays(self, tokens: int) -> bool:
        """`prefill.ride_pays` for the running batch, on the controller's measured costs."""
        return ride_pays(self.controller.costs, len(self.running), tokens)

    def _rode(self, riding: Riding) -> None:
        """Commit the prompt rows that rode in this step's pass (`_prefill`); the sequence joins once they
        complete its prompt but the last token, decoding from the next step."""
        seq, rows = riding.seq, riding.rows
        if riding.hidden is None:  # (the pass did not run)
            return
        stop = rows.start + len(rows.tokens)
        if self._isolated(seq, self.prefill.read, seq, stop, riding.hidden, riding.batch, riding.seconds) is None:
            self._release(seq)
            return
        if stop == len(seq.tokens) - 1:
            self.scheduler.join(seq)
            if self.prefill.caches_prefix(seq):
                self.prefill.save(seq)

    # ----------------------------------------------------------------------------------- leaving
    def _release(self, seq: Sequence) -> None:
        """Take `seq` (running or being prefilled) out of the batch: its whole blocks and tail saved to the prefix
        cache (unless it failed: its row may be half-written), its rows freed, its metrics added up."""
        if self.prefill.caches_prefix(seq) and seq.error is None:
            self.prefill.save(seq)
        self.scheduler.remove(seq)
        self.proposer.release(seq)
        seq.metrics.total_time = self._now() - seq.start_time
        self.metrics.merge(seq.metrics)

    def _preempt(self, seq: Sequence) -> None:
        """Take the joining or running `seq` out of the batch to the head of the queue (`Scheduler.preempt`): its
        blocks saved to the prefix cache first (it may find them again when it rejoins), what the proposer holds
        of it dropped; it joins again with its tokens so far as its prompt, its text, grammar, sampler and
        metrics as they were."""
        logger.info("request %s preempted at %d tokens: the running requests outgrew the K/V pool; it waits "
                    "at the head of the queue and recomputes them when it rejoins", seq.request_id, len(seq.tokens))
        if self.prefill.caches_prefix(seq):
            self.prefill.save(seq)
        self.scheduler.preempt(seq)
        self.proposer.preempt(seq)
        seq.metrics.preemptions += 1
        if seq.wants_prompt_logprobs:  # (part-way through its prompt: they are computed again from its start)
            seq.prompt_logprobs = [None]

    def _drop_aborted(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        outputs = []
        for seq in [s for s in self.waiting if s.request_id in self._aborted]:
            self.scheduler.remove(seq)
            self.proposer.release(seq)  # (one preempted holds what the proposer keeps outside the rows: a trie)
            seq.output.abort()
            outputs.append(seq.report([]))
        joining = [self.prefilling] if self.prefilling is not None else []
        for seq in [s for s in self.running + joining if s.request_id in self._aborted]:
            seq.output.abort()
            self._release(seq)
            outputs.append(seq.report([]))
        self._aborted.clear()
        return outputs
