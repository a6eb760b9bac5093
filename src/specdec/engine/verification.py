"""Judging one sequence's rows of a verification pass: which drafted tokens it keeps, exactly as plain
decoding would have chosen.

Every row is processed as plain decoding would have processed it (`SamplingParams`: logit bias, min_tokens,
penalties, with the history it would have had: the output so far plus the drafted tokens on the row's
path; a grammar's mask in the state after those tokens), then the draft is accepted greedily or by
rejection sampling (chains and trees). The log-probabilities reported are those of the processed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.outputs import TokenLogprob
from specdec.engine.structured import GrammarMatcher
from specdec.models.kv_cache import KVCache
from specdec.sampling import logprob_rows, process_logits, process_rows, sample
from specdec.speculative.acceptance import Verdict, greedy_accept, rejection_sample
from specdec.speculative.proposers import Draft
from specdec.speculative.tree import greedy_accept_tree, tree_rejection_sample


@dataclass(frozen=True)
class Judged:
    """One sequence's verdict on its rows of a verification pass (`judge`)."""

    verdict: Verdict
    logprobs: torch.Tensor | None  # [len(draft) + 1, V] the rows' log-probabilities, where it reports them
    slots: list[int]  # the pass rows committed, [last, *kept]: those that scored the emitted tokens


def judge(seq, draft: Draft, target_logits: torch.Tensor, cache: KVCache) -> Judged:
    """Accept or reject `draft` (target_logits [T, V]) and commit the kept slots of the pass to `seq`'s row of
    `cache`. Example: a chain of 3 whose first 2 are accepted -> slots [0, 1, 2], the row 3 slots longer."""
    verdict, logprobs = accept(seq, draft, target_logits)
    slots = [0] + [1 + i for i in verdict.kept()]
    cache.commit(seq.row, slots)
    return Judged(verdict, logprobs, slots)


def accept(seq, draft: Draft, target_logits: torch.Tensor) -> tuple[Verdict, torch.Tensor | None]:
    """target_logits: [T, V]; only the first len(draft) + 1 rows are real. Returns the verdict and, when
    the sequence reports logprobs, the log-probabilities [len(draft) + 1, V] the rows were judged by."""
    k = len(draft.tokens)
    params = seq.params
    logits = target_logits[: k + 1]
    paths = drafted_paths(draft) if params.processes_logits or seq.matcher is not None else []
    if params.processes_logits:
        logits = process_rows(logits, params, seq.prompt_ids, seq.output_ids, paths, seq.output.ends_on)
    if seq.matcher is not None:
        logits = logits.float().masked_fill(~grammar_masks(seq.matcher, draft, paths).to(logits.device),
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


def drafted_paths(draft: Draft) -> list[list[int]]:
    """For each row of a verification pass, the drafted tokens before it: a chain's first t tokens for row
    t; for a tree, the tokens on the path to node j (inclusive) for row j + 1.
    Example: chain [5, 7] -> [[], [5], [5, 7]]; tree [5, 7, 9], parents [-1, -1, 0] -> [[], [5], [7], [5, 9]]."""
    if draft.parents is None:
        return [draft.tokens[:t] for t in range(len(draft.tokens) + 1)]
    paths: list[list[int]] = [[]]
    for token, parent in zip(draft.tokens, draft.parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [token])
    return paths


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
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


def grammar_masks(matcher: GrammarMatcher, draft: Draft, paths: list[list[int]]) -> torch.Tensor:
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
