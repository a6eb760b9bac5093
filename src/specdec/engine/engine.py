"""The engine: prefill, then propose -> verify -> accept -> commit -> observe, for a batch of sequences.

It works on token ids; the tokenizer is used only for stop strings and streamed text. Each step is planned,
then run (as vLLM v1's scheduler output and model runner): `planner` decides who steps out, who joins and how
its prompt is read (`prefill` feeds it, and the prefix cache), and the K each running sequence may draft (the
controller's, `SpeculationController`), and returns a `plan.StepPlan`; who runs in which cache row is the
`scheduler`'s. The engine runs the plan's decoding step:

    proposal = proposer.propose(plan.decoding, plan.ks)  # drafts
    drafts = controller.cut(proposal.drafts, ...)  # (labelled drafts: cut where their tokens stop paying)
    plan.take_pages(cache, drafts)  # each row's K/V pages for the pass, at most the plan's
    logits, hidden = target([last, *draft] per row)  # one pass for the batch (+ the riding prompt's rows)
    per sequence: verification.judge (accept, KVCache.commit) -> Sequence.emit (OutputText.append) -> output
    proposer.observe(..., hidden); controller.report(plan.step_report(...))

It asks every proposer the same things (`Proposer`) and never which one it has. Invariant: the target cache
holds every token of a sequence but the last; a step feeds `[last, *draft]` (T = K + 1 tokens) and commits
`1 + accepted` of them. Plain decoding is the same step with an empty draft (the `NullProposer` never
drafts). A tree draft is verified in the same pass with a tree mask, and its accepted path is gathered into
place (`KVCache.commit`).

A failure is contained to the sequence it concerns (`failures`): it ends that sequence alone, with
finish_reason "abort" and `RequestOutput.error`. A draft the target pass cannot take (ids outside the
vocabulary) is replaced by an empty one. Only the shared target pass and the proposer fail the whole step.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.engine import verification
from specdec.engine.cache_pools import PrefixPages, mapped_caches, new_caches
from specdec.engine.disk_cache import DiskTier
from specdec.engine.failures import Failures
from specdec.engine.metrics import SpecMetrics
from specdec.engine.output_text import OutputText
from specdec.engine.outputs import RequestOutput
from specdec.engine.plan import StepPlan, step_report
from specdec.engine.planner import StepPlanner
from specdec.engine.prefill import Prefill
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence, request_grammar
from specdec.engine.target_pass import verifiable, verify
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import make_generator
from specdec.speculative.controller import SpeculationController
from specdec.speculative.proposers import NullProposer, Proposer


class Engine:
    def __init__(self, target, tokenizer: Tokenizer, proposer: Proposer | None = None,
                 config: EngineConfig | None = None, *, prefix_disk: DiskTier | None = None,
                 controller: SpeculationController | None = None, clock: Callable[[], float] | None = None,
                 **settings) -> None:
        """`config`: its scheduling, prefix cache and speculation bounds; `settings`: fields of those by name, for
        callers that build no config (`Engine(model, tok, max_model_len=256)` is
        `Engine(model, tok, config=EngineConfig.of(max_model_len=256))`); `prefix_disk`: the prefix cache's disk
        tier (`disk_cache.DiskTier`), or None; `controller`: the speculation policy (default: from the config);
        `clock`: what every part of a step is timed with, by the controller and the proposer too (default: the
        controller's, perf_counter after a GPU's queued work)."""
        self.config = config = (config or EngineConfig()).replace(**settings)
        sched = config.scheduler
        self.target = target
        self.vocab_size = target.config.vocab_size  # the width of its logits
        self.tokenizer = tokenizer
        self.proposer = proposer = proposer or NullProposer()
        self.max_model_len, self.prefill_chunk = sched.max_model_len, sched.prefill_chunk
        if controller is None:
            controller = SpeculationController.for_proposer(proposer, config.num_speculative_tokens, config.adaptive,
                                                            config.disable_by_batch_size, clock)
        else:
            proposer.bind(controller)
        self.controller, self._now = controller, controller.clock
        # + the widest draft: a row near the end of the context is padded to the batch's widest (never committed)
        self.widest = widest = proposer.max_width(config.num_speculative_tokens)
        mapped = mapped_caches(proposer, config.cache)
        self.cache = new_caches(target, proposer, sched, widest, config.cache.prefix_cache_blocks, mapped)
        caches = {"target": self.cache, **proposer.kv_caches}
        self.prefix_cache = PrefixCache(caches, config.cache.prefix_cache_blocks, config.cache.prefix_block_size,
                                        mapped, prefix_disk) if config.cache.prefix_cache_blocks > 0 else None
        pages = PrefixPages(self.prefix_cache, caches)
        self.scheduler = Scheduler(sched.max_batch_size, list(caches.values()),
                                   need=lambda seq: len(seq.tokens) + widest, shared=pages.shared, pinned=pages.pinned)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.metrics = SpecMetrics()  # cumulative
        self._aborted: set[str] = set()
        self.failures = Failures()
        self.prefill = Prefill(self.cache, proposer, controller, self._now, self.prefix_cache,
                               config.cache.prefix_isolation)
        self.planner = StepPlanner(target, self.scheduler, self.prefill, sched, widest, self.failures, self.metrics)
        self.chunk_budget = self.planner.chunk_budget
        self.plan: StepPlan | None = None  # the last step's

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
        """Plan the step (`StepPlanner.plan`), run its decoding pass, commit the prompt rows that rode in it;
        report what the batch emitted and who failed, and release the finished."""
        outputs = self._drop_aborted()
        self.plan = plan = self.planner.plan()
        if plan.decoding:
            outputs += self._decode(plan)
        if plan.riding is not None:
            self.planner.rode(plan.riding)
            for seq in self.running:  # the pads' pages: the rows were as wide as the prompt chunk
                self.cache.trim(seq.row, len(seq.tokens) + self.widest)
        outputs += self.failures.reports()
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self.planner.release(seq)
        return outputs

    def _decode(self, plan: StepPlan) -> list[RequestOutput]:
        """Propose, verify (one target pass for the batch, the riding prompt rows in it if any), then for each
        sequence on its own: judge and commit, append and report. A sequence whose own part raises is left out
        of what follows."""
        seqs, riding, isolated = plan.decoding, plan.riding, self.failures.isolated
        t0 = self._now()
        proposal = self.proposer.propose(seqs, plan.ks)
        drafts = self.controller.cut([verifiable(seq, d, self.vocab_size) for seq, d in zip(seqs, proposal.drafts)],
                                     [s.estimate for s in seqs])
        t1 = self._now()
        plan.take_pages(self.cache, drafts)
        target_logits, hidden = verify(self.target, self.cache, seqs, drafts, self.proposer.feature_layers,
                                       riding and riding.rows)  # [B, T, V], [B (+ 1 riding), T, F]
        t2 = self._now()
        if riding is not None:
            riding.took(hidden[len(seqs)], t2 - t1, drafts)
        judged = [isolated(seq, verification.judge, seq, draft, target_logits[b], self.cache)
                  for b, (seq, draft) in enumerate(zip(seqs, drafts))]
        live = [b for b, j in enumerate(judged) if j is not None]
        self.proposer.observe([seqs[b] for b in live], [drafts[b] for b in live], [judged[b].verdict for b in live],
                              [hidden[b, judged[b].slots] for b in live])
        draft_seconds, target_seconds = (t1 - t0) / len(seqs), (t2 - t1) / len(seqs)
        emitted = [isolated(seqs[b], seqs[b].emit, drafts[b], judged[b], draft_seconds, target_seconds) for b in live]
        done = [b for b, out in zip(live, emitted) if out is not None]
        now = self._now()
        for b in done:
            if not seqs[b].metrics.first_token_time:
                seqs[b].metrics.first_token_time = now - seqs[b].start_time
        if self.chunk_budget is not None:  # (a prompt read in a pass of its own counts as if it rode)
            self.chunk_budget.record(len(seqs), self._now() - t0 + plan.fed.seconds, plan.read + plan.fed.tokens)
        self.controller.report(step_report(plan, proposal, drafts, judged, done, t2 - t1))
        return [out for out in emitted if out is not None]

    # ----------------------------------------------------------------------------------- leaving
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
            self.planner.release(seq)
            outputs.append(seq.report([]))
        self._aborted.clear()
        return outputs
