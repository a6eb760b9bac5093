"""The acceptance step: which drafted tokens the target keeps, and the token it adds.

Output tokens of one target pass = accepted drafted tokens + one more: the *recovered* token at the
first rejection, or the *bonus* token when every drafted token was accepted. Pure functions of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # drafted tokens kept
    next_token: int  # recovered (a drafted token was rejected) or bonus token
    path: tuple[int, ...] | None = None  # tree drafts: the kept nodes, root to leaf; None: a chain's first tokens

    def kept(self) -> list[int]:
        """Indices of the kept drafted tokens."""
        return list(self.path) if self.path is not None else list(range(self.num_accepted))

    def output_tokens(self, draft_tokens: list[int]) -> list[int]:
        return [draft_tokens[i] for i in self.kept()] + [self.next_token]


def greedy_accept(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Keep drafted tokens while they equal the target's argmax; then the target's argmax.

    target_logits: [K + 1, V], row i scores the token after draft position i - 1.
    Example: draft [5, 7, 9], target argmax [5, 7, 2, 4] -> accepted 2, recovered 2; output [5, 7, 2].
    Draft [5, 7], target argmax [5, 7, 3] -> accepted 2, bonus 3; output [5, 7, 3].
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return Verdict(n, target_tokens[n])


def rejection_sample(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [K, V] processed draft distributions; None: each token is a point mass
    target_probs: torch.Tensor,  # [K + 1, V] processed target distributions
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): lossless for any draft.

    Token i is accepted with probability min(1, target_probs[i, t] / draft_probs[i, t]). At the first
    rejection the recovered token is drawn from normalize(max(0, target_probs[i] - draft_probs[i])); if
    all K are accepted the bonus token is drawn from target_probs[K]. The emitted token then follows
    target_probs exactly. A point-mass draft (n-gram) accepts t with probability target_probs[i, t] and
    recovers from target_probs[i] with t removed.

    Example: draft token 3 with draft_probs[0, 3] = 0.5 and target_probs[0, 3] = 0.25 is kept with
    probability 0.5; if rejected, the recovered token is never 3 (the residual there is 0).
    """
    K = len(draft_tokens)
    if K:
        idx = torch.tensor(draft_tokens)
        rows = torch.arange(K)
        target_p = target_probs[rows, idx]  # [K]
        draft_p = draft_probs[rows, idx] if draft_probs is not None else torch.ones(K)
        uniform = torch.rand(K, generator=generator)
        # accept iff u < target/draft, written without the division (draft_p > 0 for a drawn token)
        accepted = (uniform * draft_p < target_p).tolist()
    for i in range(K):
        if not accepted[i]:
            if draft_probs is not None:
                residual = (target_probs[i] - draft_probs[i]).clamp_(min=0)
            else:
                residual = target_probs[i].clone()
                residual[draft_tokens[i]] = 0
            if residual.sum() <= 0:  # only by rounding: target == draft
                residual = target_probs[i]
            return Verdict(i, int(torch.multinomial(residual, 1, generator=generator)))
    return Verdict(K, int(torch.multinomial(target_probs[K], 1, generator=generator)))
