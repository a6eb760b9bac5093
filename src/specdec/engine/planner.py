"""Planning a step (`StepPlan`): who steps out, who joins and how its prompt is read, the K each running
sequence may draft; and sequences leaving the batch (finished, failed, preempted).

A joining prompt is read `prefill_chunk` tokens a step at most, so that a long prompt delays the running
sequences' step by one chunk at most. Once all its prompt tokens but the last are in the cache a sequence
joins the batch (and decodes in this step), and the next waiting one takes the rest of the budget. While
sequences run (with a `ChunkBudget`), the joining one reads only as many tokens as the budget allows, and they
ride in the running ones' verification pass (`Riding`, committed by `rode`) where that costs less than a pass
of their own before it (`ride_pays`); prompts that arrive together while none decode are still fed together,
and start decoding in the same step.

Example, prefill_chunk 4, prompts of 10 and 3 tokens waiting (9 and 2 to feed): step 1 feeds tokens 0..3 of
the first, step 2 tokens 4..7, step 3 token 8 (the first joins) and tokens 0..1 of the second (it joins too).
With a chunk budget of 2 or more, the second's 2 tokens ride in the first's pass of step 4 instead, and it
decodes from step 5.
"""

from __future__ import annotations

import logging

from specdec.config import SchedulerConfig
from specdec.engine.failures import Failures
from specdec.engine.metrics import SpecMetrics
from specdec.engine.plan import PromptsRead, Riding, StepPlan
from specdec.engine.prefill import ChunkBudget, Prefill, ride_pays
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence
from specdec.speculative.proposers import Joining

logger = logging.getLogger("specdec.engine.engine")  # (where preemptions were always logged)


class StepPlanner:
    """Plans each step on the `scheduler`'s queue and batch, feeding joining prompts through `prefill` (with
    `target`); `widest`: the widest draft; `metrics`: the engine's cumulative, which leaving sequences add to."""

    def __init__(self, target, scheduler: Scheduler, prefill: Prefill, config: SchedulerConfig, widest: int,
                 failures: Failures, metrics: SpecMetrics) -> None:
        self.target, self.scheduler, self.prefill = target, scheduler, prefill
        self.cache, self.proposer, self.controller, self.clock = \
            prefill.cache, prefill.proposer, prefill.controller, prefill.clock
        self.config, self.widest = config, widest
        self.failures, self.metrics = failures, metrics
        self.chunk_budget = ChunkBudget(config.prefill_itl_factor, config.prefill_chunk) \
            if config.prefill_itl_factor else None

    def plan(self) -> StepPlan:
        """Preempt the newest while the batch outgrows the pools, read joining prompts (`prompts`), choose each
        running sequence's K, and the pages each row of the decoding pass may take (`StepPlan.pages`)."""
        preempted = []
        while (seq := self.scheduler.victim()) is not None:  # the newest steps out
            self.preempt(seq)
            preempted.append(seq)
        fed = PromptsRead()
        riding = self.prompts(fed)
        seqs = self.scheduler.running
        ks = self.controller.choose([s.estimate for s in seqs], [s.params.max_tokens - s.num_output for s in seqs],
                                    [self.config.max_model_len - len(s.tokens) for s in seqs],
                                    [len(s.tokens) for s in seqs]) if seqs else []
        plan = StepPlan(seqs, ks, riding, fed, preempted)
        plan.width = max(1 + max(map(self.proposer.max_width, ks), default=0), plan.read)
        plan.pages = [self.cache.pages_to_take(s.row, self.cache.lengths[s.row] + plan.width) for s in seqs]
        if riding is not None:
            riding.pages = self.cache.pages_to_take(riding.seq.row, riding.rows.start + plan.width)
        return plan

    def prompts(self, fed: PromptsRead) -> Riding | None:
        """Feed joining sequences up to `prefill_chunk` prompt tokens in all, in passes of their own (counted
        in `fed` while others decode), or return the rows that ride in the decoding pass (see the module)."""
        budget, prefill = self.config.prefill_chunk, self.prefill
        decoding = bool(self.scheduler.running)  # (those joining in this step have no stream to stall yet)
        while True:
            started = self.scheduler.prefilling is None
            seq = self.scheduler.joining()
            if seq is None:
                return None
            running, waiting = self.scheduler.running, self.scheduler.waiting
            batch = Joining(running, min(self.scheduler.max_batch_size, len(running) + 1 + len(waiting)))
            failed = started and prefill.caches_prefix(seq) and \
                self.failures.isolated(seq, prefill.restore, seq, batch) is None  # (started from the prefix cache)
            if failed:
                self.release(seq)
                continue
            if decoding and self.chunk_budget is not None:
                way = self._ride_or_budget(seq, budget, batch)
                if isinstance(way, Riding):
                    return way
                budget = way
            t0 = self.clock()
            n = self.failures.isolated(seq, prefill.feed, self.target, seq, budget, batch, decoding)
            if n is None:
                self.release(seq)
                continue
            if decoding and n:  # (the step's time for the chunk budget: the proposer's reading included)
                fed.tokens += n
                fed.seconds += self.clock() - t0
            budget -= n
            if self.cache.lengths[seq.row] < len(seq.tokens) - 1:
                return None  # the budget is spent
            self._join(seq)

    def _ride_or_budget(self, seq: Sequence, budget: int, batch: Joining) -> Riding | int:
        """While others decode: the rows of `seq`'s prompt that ride in their pass, where that pays; else the
        tokens a pass of its own may read (the chunk budget's, unless it wants its prompt's log-probabilities:
        those are fed a chunk at a time, as ever). Riding rows are padded as wide as the running ones."""
        running = self.scheduler.running
        room = self.cache.capacity - max(self.cache.lengths[s.row] for s in running)
        most = min(budget, room, self.chunk_budget.tokens(len(running)))
        if self.ride_pays(most):
            rows = self.prefill.rides(seq, self.scheduler.widest_ride(most, self.widest + 1))
            if rows is not None:
                return Riding(seq, rows, batch)
        elif not seq.wants_prompt_logprobs:
            return min(budget, most)
        return budget

    def ride_pays(self, tokens: int) -> bool:
        """`prefill.ride_pays` for the running batch, on the controller's measured costs."""
        return ride_pays(self.controller.costs, len(self.scheduler.running), tokens)

    def rode(self, riding: Riding) -> None:
        """Commit the prompt rows that rode in this step's pass; the sequence joins once they complete its
        prompt but the last token, decoding from the next step."""
        seq, rows = riding.seq, riding.rows
        if riding.hidden is None:  # (the pass did not run)
            return
        stop = rows.start + len(rows.tokens)
        if self.failures.isolated(seq, self.prefill.read, seq, stop, riding.hidden, riding.batch,
                                  riding.seconds) is None:
            self.release(seq)
            return
        if stop == len(seq.tokens) - 1:
            self._join(seq)

    def _join(self, seq: Sequence) -> None:
        self.scheduler.join(seq)
        if self.prefill.caches_prefix(seq):  # sequences joining later may share its prompt already
            self.prefill.save(seq)

    def release(self, seq: Sequence) -> None:
        """Take `seq` (running or being prefilled) out of the batch: its whole blocks and tail saved to the prefix
        cache (unless it failed: its row may be half-written), its rows freed, its metrics added up."""
        if self.prefill.caches_prefix(seq) and seq.error is None:
            self.prefill.save(seq)
        self.scheduler.remove(seq)
        self.proposer.release(seq)
        seq.metrics.total_time = self.clock() - seq.start_time
        self.metrics.merge(seq.metrics)

    def preempt(self, seq: Sequence) -> None:
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
