"""The engine: prefill, then propose -> verify -> accept -> commit -> observe, for a batch of sequences.

It works on token ids; the tokenizer is used only for stop strings and streamed text. Who runs in which
cache row is the scheduler's (`specdec.engine.scheduler`: rows 0..B-1 packed, one sequence joining at a time
through chunked prefill, `prefill_chunk` prompt tokens per step at most); how many tokens to draft is the
controller's (`SpeculationController`); what a sequence's text is and where it stops is its
`OutputText`'s; judging one sequence's rows is `specdec.engine.verification`'s. The engine runs the step:

    ks = controller.choose(...)                 # K for each running sequence
    proposal = proposer.propose(running, ks)    # drafts
    drafts = controller.cut(proposal.drafts, ...)  # (labelled drafts: cut where their tokens stop paying)
    logits = target([last, *draft] per row)     # one pass for the batch
    per sequence: verification.accept -> KVCache.commit -> OutputText.append -> output
    proposer.observe(...); controller.report(...)

Invariant: the target cache holds every token of a sequence but the last; a step feeds
`[last, *draft]` (T = K + 1 tokens) and commits `1 + accepted` of them. Plain decoding is the same
step with an empty draft (the `NullProposer` never drafts). A tree draft is verified in the same pass
with a tree mask, and its accepted path is gathered into place (`KVCache.commit`).

A failure is contained to the sequence it concerns: an exception in a sequence's own part of a step
(prefilling it, judging its draft, appending, detokenizing, advancing its grammar) ends that sequence
alone, with finish_reason "abort" and `RequestOutput.error`, while the rest of the batch goes on as if it
had never been there. A draft the target pass cannot take (ids outside the vocabulary) is replaced by an
empty one. Only the shared target pass and the proposer, where no one sequence can be blamed, fail the
whole step.

With a prefix cache (`prefix_cache_blocks` > 0), a joining sequence first copies the longest cached prefix of
its prompt into its row (the target's K/V and the draft's; see `specdec.engine.prefix_cache`) and prefills only the
rest; a sequence's whole blocks are saved when its prompt is in and again when it leaves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specdec.config import SamplingParams
from specdec.engine import verification
from specdec.engine.metrics import SpecMetrics
from specdec.engine.output_text import OutputText
from specdec.engine.outputs import RequestOutput, TokenLogprob
from specdec.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from specdec.engine.scheduler import Scheduler
from specdec.engine.structured import Grammar, GrammarMatcher
from specdec.engine.verification import token_logprobs
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import make_generator
from specdec.speculative.acceptance import Verdict
from specdec.speculative.controller import AcceptanceEstimate, SpeculationController, StepReport
from specdec.speculative.proposers import Draft, NullProposer, Proposer
from specdec.speculative.tree import ancestor_mask, depths

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: OutputText  # its text, and where it stops
    tokens: list[int] = field(default_factory=list)  # prompt + output
    row: int = -1
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    start_time: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs
    matcher: GrammarMatcher | None = None  # with params.response_format: the grammar's state
    error: str | None = None  # why the engine failed it (finish_reason "abort")
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes
    draft_state: Any = None  # the proposer's, for this sequence

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


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
        disable_by_batch_size: int | None = None,
        prefix_cache_blocks: int = 0,
        prefix_block_size: int = BLOCK_SIZE,
        prefix_isolation: str = "shared",
        row_tokens: int | None = None,
        row_len: int | None = None,
        controller: SpeculationController | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`controller`: the speculation policy (default: from `num_speculative_tokens`, `adaptive` and
        `disable_by_batch_size`); `prefix_isolation`: "shared" (vLLM's: requests without a `cache_salt` share
        cached prefixes with each other) or "salt" (only salted requests use the prefix cache, each salt its
        own: how much of a prompt was cached tells nothing of another tenant's prompts); `row_tokens`: the K/V
        slots all running sequences share (default: `max_batch_size` rows of `max_model_len`; fewer: short
        sequences run `max_batch_size` at once, a long one in fewer, longer rows, see `Scheduler`); `row_len`: a
        row's length while short sequences run, at most (default: `row_tokens // max_batch_size`); `clock`:
        what step parts are timed with (default: perf_counter, after a CUDA synchronize on a GPU)."""
        self.target = target
        self.vocab_size = target.config.vocab_size  # the width of its logits
        self.tokenizer = tokenizer
        self.proposer = proposer or NullProposer()
        self.max_model_len = max_model_len
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk  # prompt tokens fed per step, at most
        # + the widest draft: a row near the end of the context is padded to the batch's widest (never committed)
        widest = self.proposer.max_width(num_speculative_tokens)
        k = num_speculative_tokens if widest > 0 else 0
        self.controller = controller or SpeculationController(k, adaptive, disable_by_batch_size,
                                                              self.proposer.restart_tokens, self.proposer.guess_kinds)
        self.proposer.bind(self.controller)
        # rows of `row_tokens // max_batch_size` slots while short sequences run, fewer and longer for a long one
        row_tokens = max_batch_size * max_model_len if row_tokens is None else row_tokens
        short = min(max_model_len, row_tokens // max_batch_size, row_len or row_tokens)
        if short < 1 or row_tokens < max_model_len:
            raise ValueError(f"row_tokens {row_tokens} cannot hold one sequence of max_model_len {max_model_len}")
        self.cache = target.new_cache(max_batch_size, short + widest)
        self._draft_kv = self.proposer.cache is not None  # K/V of its own: rows and prefixes kept with the target's
        caches = [self.cache] + ([self.proposer.cache] if self._draft_kv else [])
        if self._draft_kv:  # its rows as long as the target's, + what it keeps beyond max_model_len + widest if more
            margin = max(0, self.proposer.cache.capacity - max_model_len - widest)
            self.proposer.cache.reshape(max_batch_size, self.cache.capacity + margin)
        self.scheduler = Scheduler(max_batch_size, caches, row_tokens=row_tokens * self.cache.capacity // short,
                                   need=lambda seq: len(seq.prompt_ids) + seq.params.max_tokens + widest)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.metrics = SpecMetrics()  # cumulative
        self._aborted: set[str] = set()
        self._failed: list[Sequence] = []  # failed in this step (`_isolated`), reported at its end
        sync = target.device.type == "cuda"
        self._now = clock or ((lambda: (torch.cuda.synchronize(), time.perf_counter())[1]) if sync else time.perf_counter)
        self.prefix_cache = None
        if prefix_isolation not in ("shared", "salt"):
            raise ValueError(f'prefix_isolation must be "shared" or "salt", got {prefix_isolation!r}')
        self.prefix_isolation = prefix_isolation
        if prefix_cache_blocks > 0:
            caches = {"target": self.cache, **({"draft": self.proposer.cache} if self._draft_kv else {})}
            self.prefix_cache = PrefixCache(caches, prefix_cache_blocks, prefix_block_size)

    # the scheduler's queue and batch, and the controller's costs, as seen from outside
    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def prefilling(self) -> Sequence | None:
        return self.scheduler.prefilling

    @property
    def costs(self):
        return self.controller.costs

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in (*prompt_token_ids, *params.stop_token_ids, *(t for t, _ in params.logit_bias))
               if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for this model's vocabulary of {vocab} tokens")
        grammar = None if params.response_format is None else \
            Grammar.from_response_format(params.response_format, self.tokenizer, vocab)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n + params.max_tokens} "
                f"were requested ({n} in the prompt, {params.max_tokens} to generate)"
            )
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_token_ids),
            params=params,
            generator=make_generator(params.seed),
            output=OutputText(self.tokenizer, params, self.eos_ids),
            tokens=list(prompt_token_ids),
            start_time=time.perf_counter(),
            estimate=self.controller.new_estimate(),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            matcher=grammar.matcher() if grammar is not None else None,
            cache_salt=cache_salt,
        )
        seq.metrics.prompt_tokens = n
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
        self._prefill()
        if self.running:
            outputs += self._decode(self.running)
        outputs += [self._output(seq, []) for seq in self._failed]
        self._failed.clear()
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._release(seq)
        return outputs

    def _decode(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Propose, verify (one target pass for the batch), then for each sequence on its own: judge and
        commit, append and report. A sequence whose own part raises is left out of what follows."""
        ks = self.controller.choose([s.estimate for s in seqs], [s.params.max_tokens - s.num_output for s in seqs],
                                    [self.max_model_len - len(s.tokens) for s in seqs])
        t0 = self._now()
        proposal = self.proposer.propose(seqs, ks)
        drafts = self.controller.cut([self._verifiable(seq, draft) for seq, draft in zip(seqs, proposal.drafts)],
                                     [s.estimate for s in seqs])
        t1 = self._now()
        target_logits, hidden = self._verify(seqs, drafts)  # [B, T, V], [B, T, H] or None
        t2 = self._now()
        judged = [self._isolated(seq, self._judge, seq, draft, target_logits[b])
                  for b, (seq, draft) in enumerate(zip(seqs, drafts))]
        live = [b for b, j in enumerate(judged) if j is not None]
        kept_hidden = None if hidden is None else [hidden[b, judged[b][2]] for b in live]
        self.proposer.observe([seqs[b] for b in live], [drafts[b] for b in live], [judged[b][0] for b in live],
                              kept_hidden)
        times = ((t1 - t0) / len(seqs), (t2 - t1) / len(seqs))
        emitted = [self._isolated(seqs[b], self._emit, seqs[b], drafts[b], *judged[b], times) for b in live]
        self.controller.report(StepReport(
            batch_size=len(seqs), k=max(ks), forward_seconds=proposal.forward_seconds,
            rows=len(seqs) * (1 + max(len(d.tokens) for d in drafts)), verify_seconds=t2 - t1,
            outcomes=[(seqs[b].estimate, drafts[b].depth, judged[b][0].num_accepted)
                      for b, out in zip(live, emitted) if out is not None],
            kinds=[(seqs[b].estimate, drafts[b].kinds, judged[b][0].num_accepted)
                   for b, out in zip(live, emitted) if out is not None and drafts[b].kinds]))
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
            self._record_logprobs(seq, logprobs[rows[:len(new_ids)]], new_ids)
        seq.metrics.record_step(draft.depth, verdict.num_accepted, len(new_ids), draft.source)
        seq.metrics.draft_time += times[0]
        seq.metrics.target_time += times[1]
        return self._output(seq, new_ids)

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

    def _verifiable(self, seq: Sequence, draft: Draft) -> Draft:
        """`draft`, or an empty draft if the target pass cannot take it (an id outside the vocabulary, a tree
        node whose parent is not an earlier node): one proposer row's fault must not fail the batch's pass."""
        parents = draft.parents
        if all(0 <= t < self.vocab_size for t in draft.tokens) and (parents is None or (
                len(parents) == len(draft.tokens) and all(-1 <= p < i for i, p in enumerate(parents)))):
            return draft
        logger.error("request %s: dropped a draft the target cannot verify (tokens %s, parents %s)",
                     seq.request_id, draft.tokens[:16], None if parents is None else parents[:16])
        return Draft([])

    def _verify(self, seqs: list[Sequence], drafts: list[Draft]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass over `[last, *draft]` for every sequence (right-padded to the longest): logits
        [B, T, V] and, for proposers that read them, final hidden states [B, T, H]. Tree drafts get a tree
        mask and positions by depth (chains in the same batch: a one-branch tree)."""
        width = 1 + max(len(d.tokens) for d in drafts)
        trees = any(d.parents is not None for d in drafts)
        rows, positions, masks = [], [], []
        for seq, draft in zip(seqs, drafts):
            row = [seq.tokens[-1], *draft.tokens]
            n = len(row)
            rows.append(row + [row[-1]] * (width - n))  # pads are never committed
            start = len(seq.tokens) - 1
            if not trees:
                positions.append(list(range(start, start + width)))
                continue
            parents = draft.parents if draft.parents is not None else list(range(-1, n - 2))
            mask = torch.eye(width, dtype=torch.bool)
            mask[:n, :n] = ancestor_mask(parents)
            mask[n:, 0] = True  # pads see the root only
            masks.append(mask)
            positions.append([start + d for d in [0, *depths(parents)]] + [start + 1] * (width - n))
        device = self.target.device
        needs_hidden = self.proposer.needs_hidden
        out = self.target(
            torch.tensor(rows, device=device), torch.tensor(positions, device=device), self.cache,
            mask=torch.stack(masks).to(device) if trees else None, return_hidden=needs_hidden,
        )
        return out if needs_hidden else (out, None)

    @staticmethod
    def _record_logprobs(seq: Sequence, logprobs: torch.Tensor, tokens: list[int]) -> None:
        """Append the emitted `tokens`' entries; logprobs [len(tokens), V] are their rows' log-probabilities."""
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        seq.cumulative_logprob += float(chosen.sum())
        if seq.logprobs is not None:
            seq.logprobs.extend(token_logprobs(logprobs, tokens, seq.params.logprobs))

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            new_token_ids=new_ids,
            token_ids=seq.output_ids,
            text=seq.output.text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.output.stop_reason,
            metrics=seq.metrics,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
            new_text=seq.output.new_text(),
        )
        if seq.logprobs is not None:
            out.logprobs = seq.logprobs
            out.new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_ids):]
        if seq.logprobs is not None or (seq.params.best_of or 1) > seq.params.n:
            out.cumulative_logprob = seq.cumulative_logprob
        return out

    # ----------------------------------------------------------------------------------- joining
    def _prefill(self) -> None:
        """Feed joining sequences up to `prefill_chunk` prompt tokens in all, so that a long prompt delays the
        running sequences' step by one chunk at most. Once all its prompt tokens but the last are in the
        cache a sequence joins the batch (and decodes in this step), and the next waiting one takes the rest
        of the budget.

        Example, prefill_chunk 4, prompts of 10 and 3 tokens waiting (9 and 2 to feed): step 1 feeds tokens
        0..3 of the first, step 2 tokens 4..7, step 3 token 8 (the first joins) and tokens 0..1 of the second
        (it joins too).
        """
        budget = self.prefill_chunk
        while True:
            started = self.scheduler.prefilling is None
            seq = self.scheduler.joining()
            if seq is None:
                return
            if started and self._caches_prefix(seq) and self._isolated(seq, self._restore_prefix, seq) is None:
                self._release(seq)
                continue
            fed = self._isolated(seq, self._prefill_chunk, seq, budget)
            if fed is None:
                self._release(seq)
                continue
            budget -= fed
            if self.cache.lengths[seq.row] < len(seq.prompt_ids) - 1:
                return  # the budget is spent
            self.scheduler.join(seq)
            if self._caches_prefix(seq):  # sequences joining later may share its prompt already
                self._save_prefix(seq)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """Feed the next at most `budget` prompt tokens of `seq` (in its own row); returns how many."""
        start = self.cache.lengths[seq.row]
        stop = min(len(seq.prompt_ids) - 1, start + budget)
        if stop <= start:
            return 0
        t0 = self._now()
        device = self.target.device
        chunk = torch.tensor([seq.prompt_ids[start:stop]], device=device)
        wants = seq.prompt_logprobs is not None
        needs_hidden = self.proposer.needs_hidden
        out = self.target(chunk, torch.arange(start, stop, device=device)[None], self.cache.row_view(seq.row),
                          num_logits=stop - start if wants else 1, return_hidden=needs_hidden)
        if needs_hidden:  # proposers on the target's features (Medusa, EAGLE) see the prompt's
            self.proposer.observe_prefill(seq, out[1][0])
        if wants:  # position i scores prompt token i + 1, under the model's raw distribution
            logits = out[0][0] if needs_hidden else out[0]
            seq.prompt_logprobs.extend(token_logprobs(torch.log_softmax(logits.float(), dim=-1),
                                                      seq.prompt_ids[start + 1:stop + 1], seq.params.prompt_logprobs))
        self.cache.advance(seq.row, stop - start)
        t1 = self._now()
        seq.metrics.prefill_time += t1 - t0
        self.controller.record_prefill("target", stop - start, t1 - t0)
        if self._draft_reads_prompt(seq, start):  # a draft model reads it too
            self._draft_prefill(seq, start, stop)
        return stop - start

    def _draft_prefill(self, seq: Sequence, start: int, stop: int) -> None:
        """A draft model reads prompt tokens [start, stop) of `seq` (counted as draft time)."""
        t0 = self._now()
        read = self.proposer.prefill(seq, start, stop)
        t1 = self._now()
        seq.metrics.draft_time += t1 - t0
        self.controller.record_prefill("draft", read, t1 - t0)

    def _draft_reads_prompt(self, seq: Sequence, start: int) -> bool:
        """Whether the proposer reads the prompt of `seq` from token `start` on: if it reads prompts at all,
        as the controller decides for the batch `seq` will be in (the running sequences, it and those
        waiting behind it, up to max_batch_size). If so, `seq` gets the acceptance prior of sequences whose
        prompt was read."""
        if not self.proposer.reads_prompt:
            return False
        batch = min(self.max_batch_size, len(self.running) + 1 + len(self.waiting))
        reads = self.controller.draft_reads_prompt([s.estimate for s in self.running], batch,
                                                   len(seq.prompt_ids) - 1 - start, seq.params.max_tokens)
        if reads and not seq.estimate.read_prompt:  # its acceptance is then that of drafts with their context
            seq.estimate = self.controller.new_estimate(read_prompt=True)
        return reads

    def _caches_prefix(self, seq: Sequence) -> bool:
        """Whether `seq` reads and feeds the prefix cache (with isolation "salt": only salted requests)."""
        return self.prefix_cache is not None and (self.prefix_isolation == "shared" or seq.cache_salt is not None)

    def _restore_prefix(self, seq: Sequence) -> int:
        """Start `seq` from the longest cached prefix of its prompt but the last token, in whole blocks: the
        target's K/V are copied into its row, and the draft is left as a prefill of that prefix leaves it.
        Returns how many prompt tokens it skips.

        - A request with `prompt_logprobs` is never started from the cache: its prompt's logits are wanted
          (vLLM does the same).

        - A draft model gets the blocks it has cached (possibly fewer: it had restarted on a window) and reads
          the rest itself, if it reads this prompt at all (`_draft_reads_prompt`); otherwise it gets nothing,
          as when it skips a prompt.
        - Proposers on the target's features need the feature of the token before the first one they are
          handed: the target recomputes the prefix's last token (EAGLE's cached pairs end just before it).
          EAGLE's cached blocks bound the prefix, its pairs being what cannot be recomputed without the
          features of the whole prefix.

        Example, block size 16, a 40-token prompt of which 32 are cached: plain decoding and draft models
        prefill tokens 32..38; Medusa and EAGLE prefill tokens 31..38.
        """
        if seq.prompt_logprobs is not None:
            return 0
        pc, row = self.prefix_cache, seq.row
        chain = pc.lookup(pc.keys(seq.prompt_ids[:-1], seq.cache_salt))
        if self._draft_kv and self.proposer.needs_hidden:
            chain = chain[:pc.held("draft", chain)]
        if not chain:
            return 0
        cached = pc.load("target", chain, self.cache, row)
        if self.proposer.needs_hidden:
            cached -= 1
            self.cache.truncate(row, cached)
            if self._draft_kv:
                pc.load("draft", chain, self.proposer.cache, row, self.proposer.kv_shift)
        elif self._draft_kv:
            held = chain[:pc.held("draft", chain)]
            if self._draft_reads_prompt(seq, len(held) * pc.block_size):
                self._draft_prefill(seq, pc.load("draft", held, self.proposer.cache, row), cached)
        seq.metrics.cached_tokens = cached
        return cached

    def _save_prefix(self, seq: Sequence) -> None:
        """Save the whole blocks of `seq` that its row holds: the target's, and the draft's as far as they go."""
        pc, row = self.prefix_cache, seq.row
        keys = pc.keys(seq.tokens[:self.cache.lengths[row]], seq.cache_salt)  # (it may hold tokens past a stop)
        pc.save("target", keys, self.cache, row)
        if self._draft_kv:
            drafted = self.proposer.cached_tokens(seq) // pc.block_size
            pc.save("draft", keys[:drafted], self.proposer.cache, row, self.proposer.kv_shift)

    # ----------------------------------------------------------------------------------- leaving
    def _release(self, seq: Sequence) -> None:
        """Take `seq` (running or being prefilled) out of the batch: its whole blocks saved to the prefix cache
        (unless it failed: its row may be half-written), its rows freed, its metrics added up."""
        if self._caches_prefix(seq) and seq.error is None:
            self._save_prefix(seq)
        self.scheduler.remove(seq)
        self.proposer.release(seq)
        seq.metrics.total_time = time.perf_counter() - seq.start_time
        self.metrics.merge(seq.metrics)

    def _drop_aborted(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        outputs = []
        for seq in [s for s in self.waiting if s.request_id in self._aborted]:
            self.scheduler.remove(seq)
            seq.output.abort()
            outputs.append(self._output(seq, []))
        joining = [self.prefilling] if self.prefilling is not None else []
        for seq in [s for s in self.running + joining if s.request_id in self._aborted]:
            seq.output.abort()
            self._release(seq)
            outputs.append(self._output(seq, []))
        self._aborted.clear()
        return outputs
