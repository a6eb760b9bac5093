"""Proposers on the target's own features: Medusa heads and the EAGLE head, chains or trees.

Both read the target's final hidden states: those of the prompt at prefill (`read_prompt`) and of the tokens
committed at each step (`observe`). Neither touches the target's cache; starting from a cached prefix, the
target recomputes the prefix's last token for them (`restore_prefix`).

Children of a tree node are the top-ranked tokens of the node's draft distribution when greedy, and
independent draws from it when sampling; `Draft.probs[i]` is the distribution node i was drawn from,
which is what tree rejection sampling needs to stay exact.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import partial

import torch

from specdec.sampling import process_logits
from specdec.speculative.proposers import Draft, Joining, PromptChunk, Proposer
from specdec.speculative.tree import DynamicTree, TreeShape, ancestor_mask, depths


def pick_children(seq, head, logits: torch.Tensor, vocab: int,
                  n: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
    """n child tokens from the head's logits [vocab_size] over its reduced vocabulary: the top n (greedy) or n
    independent seeded draws (sampling). Returns the tokens (the target's ids), the log-probabilities the
    head gives them, and when sampling the processed draft distribution [vocab] they were drawn from (over
    the target's vocabulary, as rejection sampling needs). Greedy picks never leave the reduced vocabulary,
    so they skip the full-vocabulary logits."""
    if seq.params.greedy:
        top = torch.topk(logits, n).indices
        logp = logits[top].float() - torch.logsumexp(logits.float(), -1)
        return head.vocab_ids[top].tolist(), logp, None
    probs = process_logits(head.expand(logits, vocab)[None], seq.params)[0]
    picked = torch.multinomial(probs, n, replacement=True, generator=seq.generator)
    return picked.tolist(), torch.log(probs[picked]), probs


class _FeatureProposer(Proposer):
    """What the head proposers share: the head, the tree shape, growing a draft.

    Chain drafts label each token with its kind of guess (`Proposer.guess_kinds`): its depth x how sure the
    head is of it (the probability the head gives the token: under 0.1, 0.25, 0.5, 0.75, 0.9, or above), so
    that the adaptive controller (`controller.ByKind`) learns each kind's acceptance and cuts each step's
    draft where its tokens stop paying for their rows: a sure guess at depth 3 is verified, an unsure one
    at depth 1 is not, which a single K for every step cannot do.
    """

    SURENESS = (0.1, 0.25, 0.5, 0.75, 0.9)

    def __init__(self, head, vocab_size: int, tree: TreeShape | DynamicTree | None, max_depth: int) -> None:
        self.head = head
        self.vocab = vocab_size  # the target's
        self.tree = tree
        self.max_depth = max_depth  # K: the engine never asks for deeper drafts
        self.guess_kinds = 0 if tree is not None else max_depth * (len(self.SURENESS) + 1)

    @classmethod
    def kind_of(cls, depth: int, prob: float) -> int:
        """The kind of a chain's token at `depth` (0: the first drafted) that the head gives probability `prob`.
        Example: depth 1, prob 0.8 -> 1 * 6 + 4 = 10."""
        return depth * (len(cls.SURENESS) + 1) + bisect_right(cls.SURENESS, prob)

    def read_prompt(self, chunk: PromptChunk) -> None:
        self.observe_hidden(chunk.seq, chunk.hidden)

    def observe_hidden(self, seq, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, H] of the tokens of `seq` just committed (prompt or output)."""
        raise NotImplementedError

    def observe(self, seqs, drafts, verdicts, hidden=None) -> None:
        for seq, h in zip(seqs, hidden):
            self.observe_hidden(seq, h)

    def usable_prefix(self, prefix, chain: list) -> int:
        """With a cache of its own (EAGLE) the blocks it holds: its pairs cannot be recomputed without the
        features of the whole prefix."""
        return len(chain) if self.cache is None else prefix.held("draft", chain)

    def restore_prefix(self, seq, prefix, chain: list, cached: int, batch: Joining) -> int:
        """It needs the feature of the token before the first one it is handed: the target recomputes the
        prefix's last token (EAGLE's cached pairs end just before it)."""
        if self.cache is not None:
            prefix.load("draft", chain, self.cache, seq.row, self.kv_shift)
        return cached - 1

    @property
    def memory_bytes(self) -> int:
        from specdec.heads.modules import head_bytes

        return head_bytes(self.head)

    def max_width(self, k: int) -> int:
        """The most tokens (tree nodes) one draft holds when asked for k (at most `max_depth`) deep."""
        k = min(k, self.max_depth)
        if isinstance(self.tree, DynamicTree):
            return self.tree.max_nodes(k)
        return len(self.tree.truncated(k).paths) if self.tree is not None and k > 0 else k

    def _shape(self, k: int) -> TreeShape | tuple[DynamicTree, int] | None:
        """The tree (or chain) to draft with at most k tokens deep."""
        if k <= 0:
            return None
        if isinstance(self.tree, DynamicTree):
            return self.tree, k
        return self.tree.truncated(k) if self.tree is not None else TreeShape.chain(k)

    def _draft(self, seq, shape, logits_of) -> Draft:
        if isinstance(shape, tuple):
            return self._draft_dynamic(seq, *shape, logits_of)
        return self._draft_static(seq, shape, logits_of)

    def _draft_dynamic(self, seq, tree: DynamicTree, depth: int, logits_of) -> Draft:
        """EAGLE-2: expand the `beam` best-scoring nodes of each depth with `top_k` children each."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        scores: list[float] = []
        frontier = [-1]
        for d in range(depth):
            logits = logits_of(frontier, tokens, parents)  # [len(frontier), vocab_size]
            new = []
            for node, lg in zip(frontier, logits):
                picked, logp, dist = pick_children(seq, self.head, lg, self.vocab, tree.top_k)
                base = 0.0 if node < 0 else scores[node]
                for t, lp in zip(picked, logp.tolist()):
                    new.append(len(tokens))
                    tokens.append(t)
                    parents.append(node)
                    scores.append(base + lp)
                    if dist is not None:
                        probs.append(dist)
            frontier = sorted(new, key=lambda i: -scores[i])[: tree.beam]
        return Draft(tokens, torch.stack(probs) if probs else None, parents)

    def _draft_static(self, seq, shape: TreeShape, logits_of) -> Draft:
        """Grow `shape` depth by depth; `logits_of(parent_nodes)` gives the head's draft logits [len,
        vocab_size] (its reduced vocabulary) at those nodes (-1: the root)."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        sureness: list[float] = []  # the head's probability of each token (chains: their kinds)
        node_of_path: dict[tuple[int, ...], int] = {(): -1}
        for depth in range(1, shape.depth + 1):
            level = [(p, path) for p, path in zip(shape.parents, shape.paths) if len(path) == depth]
            parent_paths = sorted({path[:-1] for _, path in level}, key=lambda q: node_of_path[q])
            parent_nodes = [node_of_path[q] for q in parent_paths]
            logits = logits_of(parent_nodes, tokens, parents)  # [len(parent_nodes), vocab_size]
            for q, node, lg in zip(parent_paths, parent_nodes, logits):
                children = [path for _, path in level if path[:-1] == q]  # ranks 0..n-1
                picked, logp, dist = pick_children(seq, self.head, lg, self.vocab, len(children))
                if self.guess_kinds:  # a chain: one child, the head's probability of it
                    sureness.append(float(torch.exp(logp[0])))
                for path in children:
                    node_of_path[path] = len(tokens)
                    tokens.append(picked[path[-1]])
                    parents.append(node)
                    if dist is not None:
                        probs.append(dist)
        is_chain = all(p == i - 1 for i, p in enumerate(parents))
        kinds = [self.kind_of(d, p) for d, p in enumerate(sureness)] if self.guess_kinds else None
        return Draft(tokens, torch.stack(probs) if probs else None, None if is_chain else parents, kinds)


class MedusaProposer(_FeatureProposer):
    """Head d guesses the token d + 1 places after the last one, from the last committed token's feature.
    A node at depth d takes its children from head d, whatever its path."""

    def __init__(self, head, vocab_size: int, tree: TreeShape | DynamicTree | None = None, max_depth: int = 8) -> None:
        super().__init__(head, vocab_size, tree, min(max_depth, head.config.num_heads))

    # a sequence's state (`seq.draft_state`): [H], the hidden state of its last committed token
    def observe_hidden(self, seq, hidden: torch.Tensor) -> None:
        seq.draft_state = hidden[-1]

    def draft(self, seqs, ks):
        limit = self.head.config.num_heads
        drafts = []
        for seq, k in zip(seqs, ks):
            shape = self._shape(min(k, limit))
            if shape is None or seq.draft_state is None:
                drafts.append(Draft([]))
                continue
            depth = shape[1] if isinstance(shape, tuple) else shape.depth
            logits = self.head(seq.draft_state, depth)  # [depth, vocab_size]: only the heads the draft uses
            drafts.append(self._draft(seq, shape, partial(self._head_logits, logits)))
        return drafts

    @staticmethod
    def _head_logits(logits: torch.Tensor, nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """A node at depth d (the root: 0) takes its children from head d: rows of logits [heads, vocab_size]."""
        node_depths = depths(parents)
        return logits[[0 if n < 0 else node_depths[n] for n in nodes]]


class EagleProposer(_FeatureProposer):
    """The EAGLE head drafts from features: its cache holds the pairs (target feature of token t, token
    t + 1) of every committed token; the features the target committed since are pending. A proposal
    feeds the pending pairs (committing them), then grows the tree depth by depth, each depth one pass of
    the head over all nodes so far with a tree mask (nodes never enter the head's cache)."""

    kv_shift = 1  # slot s of a row holds the pair (feature of token s, token s + 1)

    def __init__(self, head, vocab_size: int, max_batch_size: int, capacity: int,
                 tree: TreeShape | DynamicTree | None = None, max_depth: int = 8) -> None:
        super().__init__(head, vocab_size, tree, max_depth)
        self.cache = head.new_cache(max_batch_size, capacity + self.max_width(max_depth))
        self.feature_layers = head.config.feature_layers  # EAGLE-3: the target's layers it fuses

    @property
    def memory_bytes(self) -> int:
        return super().memory_bytes + self.cache.nbytes

    # a sequence's state (`seq.draft_state`): [m, H], the head's features of target states not yet paired
    def observe_hidden(self, seq, hidden: torch.Tensor) -> None:
        feats = self.head.features(hidden)  # [m, F] -> [m, H]
        seq.draft_state = feats if seq.draft_state is None else torch.cat([seq.draft_state, feats])

    def cached_tokens(self, seq) -> int:
        """Leading tokens of `seq` that the pairs in the head's cache were made of."""
        n = self.cache.lengths[seq.row]
        return n + 1 if n else 0

    def draft(self, seqs, ks):
        roots = self._feed_pending(seqs)  # [B, H] predicted feature of each sequence's last token
        drafts = []
        for b, (seq, k) in enumerate(zip(seqs, ks)):
            shape = self._shape(k)
            if shape is None or roots[b] is None:
                drafts.append(Draft([]))
                continue
            drafts.append(self._draft(seq, shape, self._logits_fn(seq, roots[b])))
        return drafts

    def _feed_pending(self, seqs) -> list[torch.Tensor | None]:
        """Feed every row's pending pairs in one pass (right-padded) and commit them."""
        device = self.cache.keys[0].device
        pairs = []
        for seq in seqs:
            start = self.cache.lengths[seq.row]
            feats = seq.draft_state
            m = 0 if feats is None else feats.shape[0]
            pairs.append((start, feats, seq.tokens[start + 1:start + 1 + m]))
        width = max(len(t) for _, _, t in pairs)
        if width == 0:
            return [None] * len(seqs)
        H = self.head.config.hidden_size
        feats = torch.zeros(len(seqs), width, H, dtype=self.head.dtype, device=device)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        positions = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        for b, (start, f, t) in enumerate(pairs):
            if t:
                feats[b, :len(t)] = f
                tokens[b, :len(t)] = torch.tensor(t)
                tokens[b, len(t):] = t[-1]
            positions[b] = torch.arange(start, start + width)
        rows = [seq.row for seq in seqs]
        if rows != list(range(len(seqs))):
            raise ValueError("EAGLE expects the running sequences in rows 0..B-1")
        if max(start for start, _, _ in pairs) + width <= self.cache.capacity:
            pred = self.head(feats, tokens, positions, self.cache)  # [B, width, H]
        else:  # padding a row near the end of its context to the widest would overflow: one pass a row
            pred = feats.new_zeros(feats.shape)
            for b, (start, _, t) in enumerate(pairs):
                if t:
                    view = self.cache.row_view(b)
                    pred[b, :len(t)] = self.head(feats[b:b + 1, :len(t)], tokens[b:b + 1, :len(t)],
                                                 positions[b:b + 1, :len(t)], view)[0]
        roots = []
        for b, (seq, (start, f, t)) in enumerate(zip(seqs, pairs)):
            self.cache.advance(seq.row, len(t))
            seq.draft_state = None
            have_root = self.cache.lengths[seq.row] == len(seq.tokens) - 1 and self.cache.lengths[seq.row] > 0
            roots.append(pred[b, len(t) - 1] if t and have_root else None)
        return roots

    def _logits_fn(self, seq, root: torch.Tensor):
        """logits_of(parent nodes) for `_draft`: reruns the head over the nodes drafted so far."""
        row, base = seq.row, len(seq.tokens) - 1  # the root's pair sits at position base - 1
        state = {"pred": None}

        def logits_of(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            if tokens:
                feats_in = [root if p < 0 else state["pred"][p] for p in parents]
                view = self.cache.row_view(row)
                mask = ancestor_mask(parents)[1:, 1:][None]
                pos = torch.tensor([[base - 1 + d for d in depths(parents)]], device=root.device)
                state["pred"] = self.head(torch.stack(feats_in)[None], torch.tensor([tokens], device=root.device),
                                          pos, view, mask=mask)[0]  # [N, H]
            hidden = torch.stack([root if n < 0 else state["pred"][n] for n in nodes])
            return self.head.logits(hidden)

        return logits_of



def default_tree(depth: int) -> TreeShape:
    """A small tree for CPUs (each node costs a target row): two guesses at each depth under the
    first-ranked path, e.g. depth 3 -> [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]."""
    choices = []
    for d in range(1, depth + 1):
        choices += [[0] * (d - 1) + [0], [0] * (d - 1) + [1]]
    return TreeShape.from_choices(choices)

