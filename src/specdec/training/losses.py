"""What the heads learn: the target's greedy choices further ahead, and for EAGLE its next feature.

- Medusa head i at token t: the target's choice for token t + 2 + i (cross-entropy);
- EAGLE at token t, input (feature t, token t + 1): the feature of token t + 1 (smooth L1) and the
  target's choice for token t + 2 (cross-entropy), also one step on its own predicted features (depth 2),
  which is how it runs when it drafts.

The heads predict over a reduced vocabulary: `to_reduced` maps a target token id to its reduced id, -100
(ignored by cross-entropy) outside it. Accuracies count top-1 agreement with the target's choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.heads.modules import EagleHead, MedusaHeads
from specdec.training.features import collate


def medusa_losses(head: MedusaHeads, batch: dict,
                  to_reduced: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Mean cross-entropy over heads; per head (correct, counted) top-1 against the target's choice."""
    hidden, target_next = batch["hidden"], batch["target_next"]  # [B, T, H], [B, T]
    T = hidden.shape[1]
    logits = head(hidden)  # [B, T, heads, V_r]
    losses, hits = [], []
    for i in range(head.config.num_heads):
        n = T - 1 - i
        labels = to_reduced[target_next[:, 1 + i:]]  # the target's choice for token t + 2 + i
        lg = logits[:, :n, i]
        losses.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), ignore_index=-100))
        hits.append(_top1(lg, target_next[:, 1 + i:], head.vocab_ids))
    return torch.stack(losses).mean(), hits


def eagle_losses(head: EagleHead, batch: dict, to_reduced: torch.Tensor, depth: int = 2, cls_weight: float = 0.1):
    """Smooth-L1 on the next feature + cls_weight x cross-entropy on the token after, at depth 1 and on
    the head's own predicted features at depth 2; per depth (correct, counted) top-1."""
    hidden, tokens, target_next = batch["hidden"], batch["tokens"], batch["target_next"]
    B, T, H = hidden.shape
    features = hidden[:, :-1]  # feature of token t
    loss, hits = 0.0, []
    for d in range(depth):
        n = T - 1 - d
        next_tokens = tokens[:, 1 + d:]  # token t + 1 (+ d)
        cache = head.new_cache(B, n)
        pred = head(features[:, :n], next_tokens, torch.arange(n)[None].expand(B, n), cache)  # feature of t + 1 (+ d)
        logits = head.logits(pred)
        labels = target_next[:, 1 + d:]  # the target's choice for token t + 2 (+ d)
        reg = F.smooth_l1_loss(pred.float(), hidden[:, 1 + d:].float())
        cls = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), to_reduced[labels].reshape(-1),
                              ignore_index=-100)
        loss = loss + (reg + cls_weight * cls) / (d + 1)
        hits.append(_top1(logits, labels, head.vocab_ids))
        features = pred[:, :-1]  # the next depth runs on the head's own predictions
    return loss, hits


def _top1(logits: torch.Tensor, labels: torch.Tensor, vocab_ids: torch.Tensor) -> tuple[int, int]:
    guess = vocab_ids[logits.argmax(-1)]
    return int((guess == labels).sum()), labels.numel()


def evaluate(head, windows: list[dict], to_reduced: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target's choice per head (Medusa) or per depth (EAGLE), over `windows`."""
    losses = medusa_losses if isinstance(head, MedusaHeads) else eagle_losses
    correct: list[int] = []
    counted: list[int] = []
    with torch.no_grad():
        for w in windows:
            _, hits = losses(head, collate([w]), to_reduced)
            correct = [a + c for a, (c, _) in zip(correct or [0] * len(hits), hits)]
            counted = [a + n for a, (_, n) in zip(counted or [0] * len(hits), hits)]
    return [round(c / max(n, 1), 4) for c, n in zip(correct, counted)]
