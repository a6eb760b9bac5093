"""What the heads learn: the target's greedy choices further ahead, and for EAGLE its next feature.

- Medusa head i at token t: the target's choice for token t + 2 + i (cross-entropy);
- EAGLE at token t, input (feature t, token t + 1): the feature of token t + 1 (smooth L1) and the
  target's choice for token t + 2 (cross-entropy), also one step on its own predicted features (depth 2),
  which is how it runs when it drafts;
- EAGLE-3 (a head with feature layers): no feature target, the target's choices over several steps of the
  head run on its own outputs with the attention it has when drafting (`ttt_losses`).

The heads predict over a reduced vocabulary: `to_reduced` maps a target token id to its reduced id, -100
(ignored by cross-entropy) outside it. Accuracies count top-1 agreement with the target's choice.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from specdec.heads.modules import EagleHead, MedusaHeads
from specdec.models.llama import rotate_half
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


def ttt_losses(head: EagleHead, batch: dict, to_reduced: torch.Tensor, steps: int = 3, decay: float = 0.8,
               soft: float = 0.0):
    """EAGLE-3's training-time test: the head run `steps` times on its own outputs, as it drafts.

    Step 1 at position t reads the target's feature of token t (`head.features`) and token t + 1; step k > 1
    reads the head's own output of step k - 1 at t and token t + k, at rope position t + k - 1, and guesses
    token t + k + 1 (the target's choice `target_next[t + k]`). Its attention sees what a drafted node sees:
    the step-1 pairs of positions <= t (the committed pairs) and its own chain, the outputs of steps 2..k at t
    (`ttt_mask`). Loss: sum over steps of decay^(k-1) x cross-entropy, against the target's greedy choice, or
    with `soft` > 0 (1 - soft) x that + soft x the cross-entropy against the target's distribution over the
    heads' vocabulary (its logits there: the head's output rows, the target's, on the stored final states; more
    of what the target knows per token than its choice alone). Returns the loss, per step (correct,
    counted) top-1 given the earlier steps' tokens, and per step whether the guess at each position agrees
    with the target (bool [B, T - steps]; `leading_agreement` of them: what a chain draft of `steps` tokens
    would accept there, teacher-forced).

    Example, steps 2, window tokens [a, b, c, d]: position 0 reads (f_a, b) then (out_1, c) and guesses the
    target's choices after b and after c."""
    hidden, tokens, target_next = batch["hidden"], batch["tokens"], batch["target_next"]  # [B, T, F], [B, T], [B, T]
    B, T, _ = hidden.shape
    n = T - steps
    x = head.features(hidden[:, :n].to(head.dtype))  # [B, n, H]
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    loss, hits, rights = 0.0, [], []
    for k in range(steps):
        positions = torch.arange(k, k + n, device=x.device)
        inputs = head.fc(torch.cat([x, head.embed(tokens[:, 1 + k:1 + k + n]).to(x.dtype)], -1))
        out, kv = _layer_over_steps(head, inputs, positions, past, ttt_mask(n, k + 1, x.device))
        past.append(kv)
        pred = head.norm(out)  # [B, n, H]
        logits = head.logits(pred)  # [B, n, V_r]
        labels = target_next[:, 1 + k:1 + k + n]
        cls = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), to_reduced[labels].reshape(-1), ignore_index=-100)
        if soft:
            with torch.no_grad():  # the target's distribution where it chose `labels`
                teacher = head.logits(hidden[:, 1 + k:1 + k + n, -head.config.hidden_size:]).softmax(-1)
            cls = (1 - soft) * cls - soft * (teacher * logits.log_softmax(-1)).sum(-1).mean()
        loss = loss + decay ** k * cls
        rights.append(head.vocab_ids[logits.argmax(-1)] == labels)  # [B, n]
        hits.append((int(rights[-1].sum()), labels.numel()))
        x = pred
    return loss, hits, rights


def walk(leading: list[int], start: int = 0) -> list[int]:
    """The drafted tokens each pass accepts when greedy decoding runs over a text the target itself chose, from
    position `start` to the end of `leading` (per position, what a pass there accepts: `leading_agreement`):
    each pass emits its accepted tokens and the target's own next one, and the next pass starts after them, as
    the engine's do. Example: leading [2, 0, 0, 1, 0, 0] -> passes at 0, 3 and 5 accept [2, 1, 0] (6 tokens
    in 3 passes)."""
    accepted = []
    t = start
    while t < len(leading):
        accepted.append(leading[t])
        t += leading[t] + 1
    return accepted


def leading_agreement(rights: list[torch.Tensor]) -> torch.Tensor:
    """How many leading steps agree at each position: what a chain of len(rights) tokens would have accepted.
    rights: per step, bool [...]. Example: steps [[1, 1, 0]], [[1, 0, 1]], [[0, 1, 1]] (3 positions) -> [[2, 1, 0]]."""
    agree = torch.ones_like(rights[0])
    count = torch.zeros(rights[0].shape, dtype=torch.long, device=rights[0].device)
    for right in rights:
        agree = agree & right
        count += agree
    return count


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """[n, step * n] bool: which keys the n queries of `step` (1-based) see among the keys of steps 1..step
    (each n long): step 1's at positions <= t, and each later step's at t alone. Example, n 2, step 2:
    [[1, 0, 1, 0], [1, 1, 0, 1]]."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(n, n, dtype=torch.bool, device=device).tril()] + [eye] * (step - 1), -1)


def _layer_over_steps(head: EagleHead, x: torch.Tensor, positions: torch.Tensor,
                      past: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor):
    """The head's decoder layer on x [B, n, H] at rope `positions` [n], attending to the K/V of earlier steps
    (`past`, each ([B, KV, n, D], [B, KV, n, D])) and its own, as `mask` [n, len(past) * n + n] allows. The
    same weights and operations as `DecoderLayer.forward` (float, `F.scaled_dot_product_attention`: training
    needs gradients, not the decoding path's bits). Returns the output [B, n, H] and this step's (K, V)."""
    layer, attn = head.layer, head.layer.self_attn
    B, n, _ = x.shape
    D = attn.head_dim
    freqs = positions.float()[:, None] * head.inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)  # [n, D]
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(B, n, attn.num_heads, D).transpose(1, 2)
    k = attn.k_proj(h).view(B, n, attn.num_kv_heads, D).transpose(1, 2)
    v = attn.v_proj(h).view(B, n, attn.num_kv_heads, D).transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    keys = torch.cat([pk for pk, _ in past] + [k], 2)
    values = torch.cat([pv for _, pv in past] + [v], 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(B, n, attn.num_heads * D))
    return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)


def _top1(logits: torch.Tensor, labels: torch.Tensor, vocab_ids: torch.Tensor) -> tuple[int, int]:
    guess = vocab_ids[logits.argmax(-1)]
    return int((guess == labels).sum()), labels.numel()


def evaluate(head, windows: list[dict], to_reduced: torch.Tensor, ttt_steps: int = 0) -> list[float]:
    """Top-1 agreement with the target's choice per head (Medusa) or per depth (EAGLE; with `ttt_steps`,
    per step of `ttt_losses`, given the earlier steps' tokens), over `windows`."""
    return evaluate_chains(head, windows, to_reduced, ttt_steps)[0]


def evaluate_chains(head, windows: list[dict], to_reduced: torch.Tensor,
                    ttt_steps: int = 0) -> tuple[list[float], float | None, float | None]:
    """`evaluate`'s top-1 per head or step, and with `ttt_steps` the tokens a chain of that many drafted tokens
    would make per target pass, teacher-forced, two ways: 1 + the mean number of leading steps agreeing with
    the target over all positions, and as greedy decoding would visit the positions (`walk`). Where a window
    is the target's own greedy answer scored from the answer's first drafted position (a window's
    "scored_from": top-1 and both figures count only positions from there), the walk is what the engine
    measures up to rounding (the engine's head runs in bf16): within 0.013 tokens a pass on HumanEval 0-11
    (`benchmarks/bench_head_walk.py`), where the mean over positions was 0.17-0.19 too high, passes starting
    after a miss, at the harder positions."""
    if isinstance(head, MedusaHeads):
        losses = medusa_losses
    else:
        losses = partial(ttt_losses, steps=ttt_steps) if ttt_steps else eagle_losses
    correct: list[int] = []
    counted: list[int] = []
    accepted = positions = walked = passes = 0
    with torch.no_grad():
        for w in windows:
            start = w.get("scored_from", 0)
            _, hits, *chain = losses(head, collate([{k: v for k, v in w.items() if k != "scored_from"}]), to_reduced)
            if chain:  # per step, agreement at each position: count those from `start`
                rights = [r[0, start:] for r in chain[0]]
                hits = [(int(r.sum()), r.numel()) for r in rights]
                leading = leading_agreement(rights)
                accepted, positions = accepted + int(leading.sum()), positions + leading.numel()
                passed = walk(leading.tolist())
                walked, passes = walked + sum(passed) + len(passed), passes + len(passed)
            correct = [a + c for a, (c, _) in zip(correct or [0] * len(hits), hits)]
            counted = [a + n for a, (_, n) in zip(counted or [0] * len(hits), hits)]
    per_step = [round(c / max(n, 1), 4) for c, n in zip(correct, counted)]
    if not positions:
        return per_step, None, None
    return per_step, round(1 + accepted / positions, 4), round(walked / max(passes, 1), 4)
