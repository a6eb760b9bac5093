"""The target's verification pass: `[last, *draft]` for every running sequence in one forward.

Rows are right-padded to the widest (pads are never committed). Chains run causally at consecutive
positions; when any draft of the batch is a tree, every row gets a tree mask and positions by depth (a
chain is then a one-branch tree). Example: a tree draft [a, b, c] with parents [-1, -1, 0] after a sequence
of 10 tokens feeds [last, a, b, c] at positions [9, 10, 10, 11], c seeing last and a only. A joining
prompt's next tokens may ride in the same pass as one more row (`PromptRows`: a chain, given no logits),
so that reading a long prompt does not stall the running sequences (see `engine.prefill.ChunkBudget`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec.models.kv_cache import KVCache
from specdec.speculative.proposers import Draft
from specdec.speculative.tree import ancestor_mask, depths

logger = logging.getLogger(__name__)


def verifiable(seq, draft: Draft, vocab_size: int) -> Draft:
    """`draft`, or an empty draft if the target pass cannot take it (an id outside the vocabulary, a tree
    node whose parent is not an earlier node): one proposer row's fault must not fail the batch's pass."""
    parents = draft.parents
    if all(0 <= t < vocab_size for t in draft.tokens) and (parents is None or (
            len(parents) == len(draft.tokens) and all(-1 <= p < i for i, p in enumerate(parents)))):
        return draft
    logger.error("request %s: dropped a draft the target cannot verify (tokens %s, parents %s)",
                 seq.request_id, draft.tokens[:16], None if parents is None else parents[:16])
    return Draft([])


@dataclass(frozen=True)
class PromptRows:
    """A joining sequence's prompt tokens `tokens`, from position `start` (its row's committed length), read
    in a verification pass as the batch's last row (`verify`): a chain of known tokens, none judged."""

    tokens: list[int]
    start: int


def verify(target, cache: KVCache, seqs: list, drafts: list[Draft], feature_layers: tuple[int, ...] = (),
           prompt: PromptRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over `[last, *draft]` for every sequence: logits [B, T, V] and the final hidden
    states [B, T, H] (for the proposers that read them), after the outputs of `feature_layers` if any
    (`Proposer.feature_layers`). With `prompt`, a joining sequence's chunk rides along as row B (the row
    after the running ones, where the scheduler keeps it): its hidden states are row B's [B + 1, T, H]; it
    gets no logits. Example: two sequences drafting 2 tokens each and an 8-token prompt chunk: rows of 3,
    3 and 8 tokens, padded to T = 8; logits [2, 8, V], hidden states [3, 8, H]."""
    rows_in = [(seq.tokens[-1], draft.tokens, len(seq.tokens) - 1, draft.parents)
               for seq, draft in zip(seqs, drafts)]  # (first token, the rest, first position, tree parents)
    if prompt is not None:
        rows_in.append((prompt.tokens[0], prompt.tokens[1:], prompt.start, None))
    width = max(1 + len(tokens) for _, tokens, _, _ in rows_in)
    trees = any(d.parents is not None for d in drafts)
    rows, positions, masks = [], [], []
    for last, tokens, start, parents in rows_in:
        row = [last, *tokens]
        n = len(row)
        rows.append(row + [row[-1]] * (width - n))  # pads are never committed
        if not trees:
            positions.append(list(range(start, start + width)))
            continue
        parents = parents if parents is not None else list(range(-1, n - 2))
        mask = torch.eye(width, dtype=torch.bool)
        mask[:n, :n] = ancestor_mask(parents)
        mask[n:, 0] = True  # pads see the root only
        masks.append(mask)
        positions.append([start + d for d in [0, *depths(parents)]] + [start + 1] * (width - n))
    device = target.device
    return target(torch.tensor(rows, device=device), torch.tensor(positions, device=device), cache,
                  mask=torch.stack(masks).to(device) if trees else None, return_hidden=True,
                  feature_layers=feature_layers, logit_rows=len(seqs) if prompt is not None else None)
