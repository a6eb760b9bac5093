"""The engine: prefill, then propose -> verify -> accept -> commit -> observe, for a batch of sequences.

It works on token ids; the tokenizer is used only for stop strings and streamed text. Running sequences
occupy KV-cache rows 0..B-1 of the target (and of a draft model); a finished sequence's row is refilled
by the last one, so the batch stays packed. A joining sequence is prefilled `prefill_chunk` prompt tokens
per step at most, in row B (one such sequence at a time, `Engine.prefilling`), while rows 0..B-1 keep
decoding; it joins them once its prompt is in the cache.

Invariant: the target cache holds every token of a sequence but the last; a step feeds
`[last, *draft]` (T = K + 1 tokens) and commits `1 + accepted` of them. Plain decoding is the same
step with an empty draft. A tree draft is verified in the same pass with a tree mask, and its accepted
path is gathered into place (`KVCache.commit`).

A failure is contained to the sequence it concerns: an exception in a sequence's own part of a step
(prefilling it, judging its draft, appending, detokenizing, advancing its grammar) ends that sequence
alone, with finish_reason "abort" and `RequestOutput.error`, while the rest of the batch goes on as if it
had never been there. A draft the target pass cannot take (ids outside the vocabulary) is replaced by an
empty one. Only the shared target pass and the proposer, where no one sequence can be blamed, fail the
whole step.
With a prefix cache (`prefix_cache_blocks` > 0), a joining sequence first copies the longest cached prefix of
its prompt into its row (the target's K/V and the draft's; see `specdec.prefix_cache`) and prefills only the
rest; a sequence's whole blocks are saved when its prompt is in and again when it leaves.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.metrics import SpecMetrics
from specdec.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.outputs import RequestOutput, TokenLogprob
from specdec.prefix_cache import BLOCK_SIZE, PrefixCache
from specdec.sampling import logprob_rows, make_generator, process_logits, process_rows, sample
from specdec.speculative.acceptance import Verdict, greedy_accept, rejection_sample
from specdec.speculative.controller import AcceptanceEstimate, AdaptiveK, CostModel, FixedK
from specdec.speculative.proposers import Draft, Proposer
from specdec.speculative.tree import ancestor_mask, depths, greedy_accept_tree, tree_rejection_sample
from specdec.stop_strings import StopStrings
from specdec.structured import Grammar, GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    tokens: list[int] = field(default_factory=list)  # prompt + output
    row: int = -1
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    start_time: float = 0.0
    text: str = ""
    emitted_chars: int = 0  # how much of `text` earlier outputs carried
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: EOS (unless ignored) and stop_token_ids
    stops: StopStrings | None = None  # params.stop, ready to match
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs
    matcher: GrammarMatcher | None = None  # with params.response_format: the grammar's state
    error: str | None = None  # why the engine failed it (finish_reason "abort")
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]


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
    ) -> None:
        self.target = target
        self.vocab_size = target.config.vocab_size  # the width of its logits
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk  # prompt tokens fed per step, at most
        k = num_speculative_tokens if proposer is not None else 0
        self.controller = AdaptiveK(k) if adaptive and k > 0 else FixedK(k)
        self.costs = CostModel()
        self.disable_by_batch_size = disable_by_batch_size
        # + the widest draft (k tokens, or a tree's nodes): a row near the end of the context is padded to
        # the batch's widest draft (never committed)
        widest = max(k, getattr(proposer, "max_draft_tokens", 0)) if proposer is not None else 0
        self.cache = target.new_cache(max_batch_size, max_model_len + widest)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None  # joining: its prompt half in the cache, in row len(running)
        self.metrics = SpecMetrics()  # cumulative
        self.acceptance = AcceptanceEstimate()  # over all sequences: the prior of new ones
        self._aborted: set[str] = set()
        self._failed: list[Sequence] = []  # failed in this step (`_isolated`), reported at its end
        self._sync = target.device.type == "cuda"
        self._needs_hidden = bool(getattr(proposer, "needs_hidden", False))
        # proposers with K/V of their own (a draft model, EAGLE) have them cached with the target's
        self._draft_kv = getattr(proposer, "kv_shift", None) is not None
        self.prefix_cache = None
        if prefix_cache_blocks > 0:
            caches = {"target": self.cache, **({"draft": proposer.cache} if self._draft_kv else {})}
            self.prefix_cache = PrefixCache(caches, prefix_cache_blocks, prefix_block_size)

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
            detokenizer=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True),
            tokens=list(prompt_token_ids),
            start_time=time.perf_counter(),
            estimate=AcceptanceEstimate.with_prior(self.acceptance.rate),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids),
            stops=StopStrings(params.stop) if params.stop else None,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            matcher=grammar.matcher() if grammar is not None else None,
            cache_salt=cache_salt,
        )
        seq.metrics.prompt_tokens = n
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling is not None or self._aborted)

    def num_queued(self) -> int:
        """Waiting requests that the next step cannot start: those queued behind a full batch.
        Example: max_batch_size 2, one running, three waiting -> 2 (one of the three takes the free row)."""
        free = self.max_batch_size - len(self.running) - (self.prefilling is not None)
        return max(0, len(self.waiting) - free)

    # ----------------------------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs = self._drop_aborted()
        self._prefill()
        if self.running:
            outputs += self._decode(self.running)
        outputs += [self._output(seq, []) for seq in self._failed]
        self._failed.clear()
        self._retire_finished()
        return outputs

    def _decode(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Propose, verify (one target pass for the batch), then for each sequence on its own: judge and
        commit, append and report. A sequence whose own part raises is left out of what follows."""
        ks = self._choose_k(seqs)
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks) if self.proposer is not None and max(ks) > 0 else \
            [Draft([]) for _ in seqs]
        drafts = [self._verifiable(seq, draft) for seq, draft in zip(seqs, drafts)]
        t1 = self._now()
        target_logits, hidden = self._verify(seqs, drafts)  # [B, T, V], [B, T, H] or None
        t2 = self._now()
        judged = [self._isolated(seq, self._judge, seq, draft, target_logits[b])
                  for b, (seq, draft) in enumerate(zip(seqs, drafts))]
        live = [b for b, j in enumerate(judged) if j is not None]
        if self.proposer is not None:
            kept_hidden = None if hidden is None else [hidden[b, judged[b][2]] for b in live]
            self.proposer.observe([seqs[b] for b in live], [drafts[b] for b in live], [judged[b][0] for b in live],
                                  kept_hidden)
        self._record_costs(seqs, drafts, t1 - t0, t2 - t1, max(ks))
        times = ((t1 - t0) / len(seqs), (t2 - t1) / len(seqs))
        emitted = [self._isolated(seqs[b], self._emit, seqs[b], drafts[b], *judged[b], times) for b in live]
        return [out for out in emitted if out is not None]

    def _judge(self, seq: Sequence, draft: Draft, target_logits: torch.Tensor
               ) -> tuple[Verdict, torch.Tensor | None, list[int]]:
        """Accept or reject `draft` (target_logits [T, V]) and commit the kept slots of the pass: the verdict,
        the log-probabilities of its rows (see `_accept`), and the pass rows `[last, *kept]` committed, which
        scored the emitted tokens."""
        verdict, logprobs = self._accept(seq, draft, target_logits)
        slots = [0] + [1 + i for i in verdict.kept()]
        self.cache.commit(seq.row, slots)
        return verdict, logprobs, slots

    def _emit(self, seq: Sequence, draft: Draft, verdict: Verdict, logprobs: torch.Tensor | None, rows: list[int],
              times: tuple[float, float]) -> RequestOutput:
        """Append the verdict's tokens to `seq` (stop rules applied), record them, and report its output."""
        new_ids = self._append(seq, verdict.output_tokens(draft.tokens))
        if logprobs is not None:
            self._record_logprobs(seq, logprobs[rows[:len(new_ids)]], new_ids)
        depth, decay = draft.depth, getattr(self.controller, "decay", 1.0)
        seq.metrics.record_step(depth, verdict.num_accepted, len(new_ids))
        seq.metrics.draft_time += times[0]
        seq.metrics.target_time += times[1]
        seq.estimate.update(depth, verdict.num_accepted, decay)
        self.acceptance.update(depth, verdict.num_accepted, decay)
        return self._output(seq, new_ids)

    def _isolated(self, seq: Sequence, fn, *args):
        """`fn(*args)`, a part of the step that concerns `seq` alone; None if it raised: then `seq` fails
        (finish_reason "abort", `error` set; reported and released at the end of the step) and the others
        go on. Example: a NaN in one sequence's probabilities makes its draw raise; only it ends."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed in the engine; the other requests go on", seq.request_id)
            seq.finish_reason, seq.error = "abort", f"{type(e).__name__}: {e}"
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

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _choose_k(self, seqs: list[Sequence]) -> list[int]:
        if self.disable_by_batch_size is not None and len(seqs) > self.disable_by_batch_size:
            return [0] * len(seqs)
        ks = self.controller.choose([s.estimate for s in seqs], self.costs,
                                    remaining=[s.params.max_tokens - s.num_output for s in seqs],
                                    restart_tokens=getattr(self.proposer, "window", 0))
        # never draft past max_tokens (a pass emits k + 1 tokens) or past the context
        return [
            max(0, min(k, s.params.max_tokens - s.num_output - 1, self.max_model_len - len(s.tokens) - 1))
            for k, s in zip(ks, seqs)
        ]

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
        out = self.target(
            torch.tensor(rows, device=device), torch.tensor(positions, device=device), self.cache,
            mask=torch.stack(masks).to(device) if trees else None, return_hidden=self._needs_hidden,
        )
        return out if self._needs_hidden else (out, None)

    def _accept(self, seq: Sequence, draft: Draft, target_logits: torch.Tensor) -> tuple[Verdict, torch.Tensor | None]:
        """target_logits: [T, V]; only the first len(draft) + 1 rows are real. Returns the verdict and, when
        the sequence reports logprobs, the log-probabilities [len(draft) + 1, V] the rows were judged by."""
        k = len(draft.tokens)
        params = seq.params
        logits = target_logits[: k + 1]
        paths = _drafted_paths(draft) if params.processes_logits or seq.matcher is not None else []
        if params.processes_logits:
            logits = process_rows(logits, params, seq.prompt_ids, seq.output_ids, paths, seq.stop_ids)
        if seq.matcher is not None:
            logits = logits.float().masked_fill(~_grammar_masks(seq.matcher, draft, paths).to(logits.device),
                                                float("-inf"))
        target_probs = None if params.greedy else process_logits(logits, params)
        if draft.parents is not None:
            verdict = greedy_accept_tree(draft.tokens, draft.parents, logits) if params.greedy else \
                tree_rejection_sample(draft.tokens, draft.parents, draft.probs, target_probs, seq.generator)
        elif params.greedy:
            verdict = greedy_accept(draft.tokens, logits)
        elif k == 0:
            verdict = Verdict(0, sample(target_probs[0], seq.generator))
        else:
            verdict = rejection_sample(draft.tokens, draft.probs, target_probs, seq.generator)
        wants = params.logprobs is not None or (params.best_of or 1) > params.n
        return verdict, (logprob_rows(logits, params, target_probs) if wants else None)

    @staticmethod
    def _record_logprobs(seq: Sequence, logprobs: torch.Tensor, tokens: list[int]) -> None:
        """Append the emitted `tokens`' entries; logprobs [len(tokens), V] are their rows' log-probabilities."""
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        seq.cumulative_logprob += float(chosen.sum())
        if seq.logprobs is not None:
            seq.logprobs.extend(_token_logprobs(logprobs, tokens, seq.params.logprobs))

    def _record_costs(self, seqs, drafts, draft_time: float, target_time: float, k_max: int) -> None:
        B = len(seqs)
        if k_max > 0 and self.proposer is not None:
            # a draft model times its drafting forwards itself (catching up on skipped tokens is no step cost)
            per_forward = getattr(self.proposer, "forward_seconds", draft_time / k_max)
            if per_forward is not None:
                self.costs.record_draft(B, per_forward)
        width = 1 + max(len(d.tokens) for d in drafts)
        self.costs.record_verify(B * width, target_time)

    # ----------------------------------------------------------------------------------- stop rules
    def _append(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """Append emitted tokens one by one, stopping exactly at EOS, a stop string or max_tokens."""
        params = seq.params
        added: list[int] = []
        for token in new_tokens:
            seq.tokens.append(token)
            added.append(token)
            if seq.matcher is not None:
                seq.matcher.advance([token])
            if token in self.eos_ids and not params.ignore_eos:
                seq.finish_reason, seq.stop_reason = "stop", token
                break
            start = len(seq.text)
            seq.text += seq.detokenizer.add([token])
            if token in seq.stop_ids:  # a stop_token_ids token: kept in the output (as in vLLM)
                seq.finish_reason, seq.stop_reason = "stop", token
                break
            if seq.stops is not None and self._hit_stop_string(seq, start):
                break
            if seq.num_output >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
                seq.finish_reason = "length"
                break
        if seq.finish_reason is not None and seq.stop_reason is None:
            start = len(seq.text)
            seq.text += seq.detokenizer.flush()
            if seq.stops is not None:
                self._hit_stop_string(seq, start)
        return added

    @staticmethod
    def _hit_stop_string(seq: Sequence, start: int) -> bool:
        """Whether a stop string ends in the text added from `start` on; if so, cut the text before it and stop.
        Of several, the one completed first (see `StopStrings.find`)."""
        hit = seq.stops.find(seq.text, start)
        if hit is None:
            return False
        seq.text = seq.text[:hit[0]]
        seq.finish_reason, seq.stop_reason = "stop", hit[1]
        return True

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            new_token_ids=new_ids,
            token_ids=seq.output_ids,
            text=seq.text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            metrics=seq.metrics,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
        )
        if seq.logprobs is not None:
            out.logprobs = seq.logprobs
            out.new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_ids):]
        if seq.logprobs is not None or (seq.params.best_of or 1) > seq.params.n:
            out.cumulative_logprob = seq.cumulative_logprob
        end = len(seq.text)
        if seq.finish_reason is None and seq.stops is not None:  # hold back a tail that may yet begin a stop string
            end = max(seq.emitted_chars, end - (seq.stops.longest - 1))
        out.new_text = seq.text[seq.emitted_chars:end]
        seq.emitted_chars = end
        return out

    # ----------------------------------------------------------------------------------- batch rows
    def _prefill(self) -> None:
        """Feed joining sequences up to `prefill_chunk` prompt tokens in all, so that a long prompt delays the
        running sequences' step by one chunk at most. The sequence being prefilled holds the row after the
        running ones; once all its prompt tokens but the last are in the cache it joins them (and decodes
        in this step), and the next waiting one takes the rest of the budget.

        Example, prefill_chunk 4, prompts of 10 and 3 tokens waiting (9 and 2 to feed): step 1 feeds tokens
        0..3 of the first, step 2 tokens 4..7, step 3 token 8 (the first joins) and tokens 0..1 of the second
        (it joins too).
        """
        budget = self.prefill_chunk
        while True:
            if self.prefilling is None:
                if not self.waiting or len(self.running) >= self.max_batch_size:
                    return
                self.prefilling = self.waiting.popleft()
                self.prefilling.row = len(self.running)
                self._free_row(self.prefilling.row)  # empty already (rows past the batch are freed); made sure
                if self.prefix_cache is not None and self._isolated(
                        self.prefilling, self._restore_prefix, self.prefilling) is None:
                    self._release(self.prefilling)
                    continue
            seq = self.prefilling
            fed = self._isolated(seq, self._prefill_chunk, seq, budget)
            if fed is None:
                self._release(seq)
                continue
            budget -= fed
            if self.cache.lengths[seq.row] < len(seq.prompt_ids) - 1:
                return  # the budget is spent
            self.prefilling = None
            self.running.append(seq)  # its row is len(running) before the append: the batch stays packed
            if self.prefix_cache is not None:  # sequences joining later may share its prompt already
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
        out = self.target(chunk, torch.arange(start, stop, device=device)[None], self.cache.row_view(seq.row),
                          num_logits=stop - start if wants else 1, return_hidden=self._needs_hidden)
        if self._needs_hidden:  # proposers on the target's features (Medusa, EAGLE) see the prompt's
            self.proposer.observe_prefill(seq, out[1][0])
        if wants:  # position i scores prompt token i + 1, under the model's raw distribution
            logits = out[0][0] if self._needs_hidden else out[0]
            seq.prompt_logprobs.extend(_token_logprobs(torch.log_softmax(logits.float(), dim=-1),
                                                       seq.prompt_ids[start + 1:stop + 1], seq.params.prompt_logprobs))
        self.cache.advance(seq.row, stop - start)
        t1 = self._now()
        seq.metrics.prefill_time += t1 - t0
        self.costs.record_prefill("target", stop - start, t1 - t0)
        if hasattr(self.proposer, "prefill") and self._draft_reads_prompt(seq, start):  # a draft model reads it too
            self._draft_prefill(seq, start, stop)
        return stop - start

    def _draft_prefill(self, seq: Sequence, start: int, stop: int) -> None:
        """A draft model reads prompt tokens [start, stop) of `seq` (counted as draft time)."""
        t0 = self._now()
        read = self.proposer.prefill(seq, start, stop)
        t1 = self._now()
        seq.metrics.draft_time += t1 - t0
        self.costs.record_prefill("draft", read, t1 - t0)

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
        if self._draft_kv and self._needs_hidden:
            chain = chain[:pc.held("draft", chain)]
        if not chain:
            return 0
        cached = pc.load("target", chain, self.cache, row)
        if self._needs_hidden:
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
            drafted = self.proposer.cached_tokens(row) // pc.block_size
            pc.save("draft", keys[:drafted], self.proposer.cache, row, self.proposer.kv_shift)

    def _draft_reads_prompt(self, seq: Sequence, start: int) -> bool:
        """Whether a draft model should read the prompt of `seq` from token `start` on (otherwise a later
        speculative step restarts the draft on a short window). Fixed K: yes. Adaptive: if K > 0 wins for
        the batch it will be in (the running sequences, this one and those waiting behind it, up to
        max_batch_size; new ones at the mean acceptance so far), and the time saved over its `max_tokens`
        exceeds the reading (`AdaptiveK.prompt_pays`); not before anything is measured (the first step is
        a probe)."""
        B = min(self.max_batch_size, len(self.running) + 1 + len(self.waiting))
        if self.disable_by_batch_size is not None and B > self.disable_by_batch_size:
            return False
        if not self.controller.adaptive:
            return self.controller.k_max > 0
        rates = [s.estimate.rate for s in self.running] + [self.acceptance.rate] * (B - len(self.running))
        return self.controller.prompt_pays(rates, self.costs, len(seq.prompt_ids) - 1 - start, seq.params.max_tokens)

    def _retire_finished(self) -> None:
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the row of `seq` (running or being prefilled), keeping rows packed: the last running sequence
        takes the freed row and the sequence being prefilled, if any, the row after the running ones."""
        if self.prefix_cache is not None and seq.error is None:  # (a failed sequence's row may be half-written)
            self._save_prefix(seq)
        if seq is self.prefilling:
            self.prefilling = None
            self._free_row(seq.row)
        else:
            row = seq.row
            last = self.running.pop()
            if last is not seq:
                self.running[row] = last
                self._move_row(last, row)
            else:
                self._free_row(row)
            if self.prefilling is not None:
                self._move_row(self.prefilling, len(self.running))
        seq.metrics.total_time = time.perf_counter() - seq.start_time
        self.metrics.merge(seq.metrics)

    def _move_row(self, seq: Sequence, row: int) -> None:
        """Move `seq` (target and draft cache) into the free `row`, and free the row it leaves."""
        self.cache.move_row(seq.row, row)
        if self.proposer is not None:
            self.proposer.move_row(seq.row, row)
        self._free_row(seq.row)
        seq.row = row

    def _free_row(self, row: int) -> None:
        self.cache.lengths[row] = 0
        if self.proposer is not None:
            self.proposer.release(row)

    def _drop_aborted(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        outputs = []
        for seq in [s for s in self.waiting if s.request_id in self._aborted]:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
            outputs.append(self._output(seq, []))
        joining = [self.prefilling] if self.prefilling is not None else []
        for seq in [s for s in self.running + joining if s.request_id in self._aborted]:
            seq.finish_reason = "abort"
            self._release(seq)
            outputs.append(self._output(seq, []))
        self._aborted.clear()
        return outputs


def _drafted_paths(draft: Draft) -> list[list[int]]:
    """For each row of a verification pass, the drafted tokens before it: a chain's first t tokens for row
    t; for a tree, the tokens on the path to node j (inclusive) for row j + 1.
    Example: chain [5, 7] -> [[], [5], [5, 7]]; tree [5, 7, 9], parents [-1, -1, 0] -> [[], [5], [7], [5, 9]]."""
    if draft.parents is None:
        return [draft.tokens[:t] for t in range(len(draft.tokens) + 1)]
    paths: list[list[int]] = [[]]
    for token, parent in zip(draft.tokens, draft.parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [token])
    return paths


def _token_logprobs(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Entries for `tokens` from their rows' log-probabilities [len(tokens), V], with the `top` best."""
    if not tokens:
        return []
    logprobs = logprobs[: len(tokens)]
    ids = torch.tensor(tokens)[:, None]
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    best = torch.topk(logprobs, top, dim=-1) if top else None
    entries = []
    for i, token in enumerate(tokens):
        alternatives = () if best is None else tuple(zip(best.indices[i].tolist(), best.values[i].tolist()))
        entries.append(TokenLogprob(token, float(chosen[i, 0]), int(ranks[i]), alternatives))
    return entries


def _grammar_masks(matcher: GrammarMatcher, draft: Draft, paths: list[list[int]]) -> torch.Tensor:
    """Bool [T, V]: the tokens the grammar allows at each row of a pass, in the state after the drafted
    tokens on the row's path. A row past a token the grammar forbids is never reached (that token is
    rejected): it is left unmasked."""
    if draft.parents is None:
        masks, n = matcher.masks_along(draft.tokens)
        if n < len(paths):
            masks = torch.cat([masks, torch.ones(len(paths) - n, masks.shape[1], dtype=torch.bool)])
        return masks
    rows = []
    for path in paths:
        masks, n = matcher.masks_along(path)
        rows.append(masks[-1] if n == len(path) + 1 else torch.ones(masks.shape[1], dtype=torch.bool))
    return torch.stack(rows)
