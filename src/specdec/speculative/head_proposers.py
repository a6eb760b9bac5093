"""Proposers on the target's own features: Medusa heads and the EAGLE head, chains or trees.

Both read the target's final hidden states: those of the prompt at prefill (`read_prompt`) and of the tokens
committed at each step (`observe`). Neither touches the target's cache; starting from a cached prefix, the
target recomputes the prefix's last token for them (`restore_prefix`).

Children of a tree node are the top-ranked tokens of the node's draft distribution when greedy, and
independent draws from it when sampling; `Draft.probs[i]` is the distribution node i was drawn from,
which is what tree rejection sampling needs to stay exact.

All sequences' drafts grow together, a depth at a time (`Growth`): each depth's logits at every sequence's
frontier come from one call of the output layer, and EAGLE's head runs once a depth for all of them. On the
block kernels, whose rows do not depend on what is computed beside them, the drafts are those of one
sequence and one node at a time, bit for bit.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache, partial

import torch

from specdec.models.kv_cache import KEY_BLOCK, KVCache
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
        best, top = torch.topk(logits, n)
        logp = best.float() - torch.logsumexp(logits.float(), -1)
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
    def kinds_at(cls, depth: int) -> range:
        """Every kind of a chain's token at `depth` (0: the first drafted). Example: depth 1 -> 6..11."""
        return range(cls.kind_of(depth, 0.0), cls.kind_of(depth, 1.0) + 1)

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

    @property
    def usable_tail(self) -> bool:
        """Not with a cache of its own (EAGLE): tails hold the target's K/V only."""
        return self.cache is None

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
        return self.tree.truncated(k) if self.tree is not None else _chain(k)

    def draft(self, seqs, ks):
        """Grow every sequence's draft a depth at a time, each depth's logits for all of them in one call
        of the output layer (`_frontier_logits`)."""
        growths = self._start(seqs, ks)  # a `Growth` per sequence, None: no draft
        live = [g for g in growths if g is not None]
        while live:
            logits = self._frontier_logits(live)  # [sum of the frontiers, vocab_size]
            at = 0
            for g in live:
                n = len(g.frontier)
                g.grow(logits[at:at + n])
                at += n
            live = [g for g in live if not g.done]
            if live:
                self._deepen(seqs, growths)
        return [Draft([]) if g is None else g.draft() for g in growths]

    def _start(self, seqs, ks) -> list["Growth | None"]:
        raise NotImplementedError

    def _frontier_logits(self, growths: list["Growth"]) -> torch.Tensor:
        """The head's logits [sum of len(g.frontier), vocab_size] at the frontier nodes of `growths`, in order."""
        raise NotImplementedError

    def _deepen(self, seqs, growths: list["Growth | None"]) -> None:
        """Between two depths (the new frontiers drawn): what the next depth's logits need."""


_chain = lru_cache(maxsize=64)(TreeShape.chain)  # (built once per K)


@lru_cache(maxsize=256)
def _levels(shape: TreeShape) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """For each depth of `shape`: the nodes whose children it draws, in node order (-1: the root), and how
    many children each. Example: the default tree of depth 2, paths [0], [1], [0, 0], [0, 1] ->
    (((-1,), (2,)), ((0,), (2,)))."""
    node_depths = depths(shape.parents)
    levels = []
    for d in range(1, shape.depth + 1):
        counts: dict[int, int] = {}
        for parent, nd in zip(shape.parents, node_depths):
            if nd == d:
                counts[parent] = counts.get(parent, 0) + 1
        nodes = sorted(counts)
        levels.append((tuple(nodes), tuple(counts[n] for n in nodes)))
    return tuple(levels)


class Growth:
    """One sequence's draft, grown a depth at a time: `frontier` holds the nodes whose children the next
    depth draws (-1: the root), `grow` draws them from the head's logits at those nodes. Static shapes number
    their nodes in the shape's order (depth, then path); a dynamic tree (EAGLE-2) expands the `beam` nodes of
    the best path scores (sums of the draft's log-probabilities) with `top_k` children each.

    Example: the default tree of depth 2 draws 2 children of the root (nodes 0, 1), then 2 of node 0 (2, 3):
    parents [-1, -1, 0, 0]."""

    def __init__(self, seq, head, vocab: int, shape: TreeShape | tuple[DynamicTree, int], labelled: bool) -> None:
        self.seq, self.head, self.vocab = seq, head, vocab
        self.dynamic, self.depth_limit = (shape[0], shape[1]) if isinstance(shape, tuple) else (None, shape.depth)
        self.levels = None if self.dynamic is not None else _levels(shape)
        self.labelled = labelled  # a chain: label each token with the head's probability of it
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[torch.Tensor] = []  # sampling: the distribution each node was drawn from, [vocab]
        self.sureness: list[float] = []
        self.scores: list[float] = []  # dynamic: each node's path score
        self.depth = 0  # depths drawn
        self.frontier = [-1]
        self.state: torch.Tensor | None = None  # what its proposer keeps for it (the heads' logits, predictions)

    @property
    def done(self) -> bool:
        return self.depth >= self.depth_limit

    def grow(self, logits: torch.Tensor) -> list[int]:
        """Draw the children of the frontier from the head's logits [len(frontier), vocab_size] at its nodes;
        returns the new nodes and moves the frontier to the nodes the next depth expands."""
        counts = self.levels[self.depth][1] if self.levels else [self.dynamic.top_k] * len(self.frontier)
        new = []
        for node, lg, n in zip(self.frontier, logits, counts):
            picked, logp, dist = pick_children(self.seq, self.head, lg, self.vocab, n)
            if self.labelled:
                self.sureness.append(float(torch.exp(logp[0])))
            base = 0.0 if node < 0 else self.scores[node]
            for t, lp in zip(picked, logp.tolist() if self.dynamic else [0.0] * n):
                new.append(len(self.tokens))
                self.tokens.append(t)
                self.parents.append(node)
                self.scores.append(base + lp)
                if dist is not None:
                    self.probs.append(dist)
        self.depth += 1
        if self.done:
            self.frontier = []
        elif self.dynamic is not None:
            self.frontier = sorted(new, key=lambda i: -self.scores[i])[: self.dynamic.beam]
        else:
            self.frontier = list(self.levels[self.depth][0])
        return new

    def draft(self) -> Draft:
        probs = torch.stack(self.probs) if self.probs else None
        if self.dynamic is not None:
            return Draft(self.tokens, probs, self.parents)
        is_chain = all(p == i - 1 for i, p in enumerate(self.parents))
        kinds = [_FeatureProposer.kind_of(d, p) for d, p in enumerate(self.sureness)] if self.labelled else None
        return Draft(self.tokens, probs, None if is_chain else self.parents, kinds)


class MedusaProposer(_FeatureProposer):
    """Head d guesses the token d + 1 places after the last one, from the last committed token's feature.
    A node at depth d takes its children from head d, whatever its path."""

    def __init__(self, head, vocab_size: int, tree: TreeShape | DynamicTree | None = None, max_depth: int = 8) -> None:
        super().__init__(head, vocab_size, tree, min(max_depth, head.config.num_heads))

    # a sequence's state (`seq.draft_state`): [H], the hidden state of its last committed token
    def observe_hidden(self, seq, hidden: torch.Tensor) -> None:
        seq.draft_state = hidden[-1]

    def _start(self, seqs, ks):
        """Every head the drafts use, for every sequence, in one call: `Growth.state` [depth, vocab_size]."""
        limit = self.head.config.num_heads
        growths = []
        for seq, k in zip(seqs, ks):
            shape = self._shape(min(k, limit)) if seq.draft_state is not None else None
            growths.append(None if shape is None else Growth(seq, self.head, self.vocab, shape, self.guess_kinds > 0))
        live = [(seq, g) for seq, g in zip(seqs, growths) if g is not None]
        if live:
            states = torch.stack([seq.draft_state for seq, _ in live])  # [B', H]
            logits = self.head(states, max(g.depth_limit for _, g in live))  # [B', depth, vocab_size]
            for (_, g), lg in zip(live, logits):
                g.state = lg
        return growths

    def _frontier_logits(self, growths):
        """A node at depth d (the root: 0) takes its children from head d."""
        return torch.cat([g.state[g.depth].expand(len(g.frontier), -1) for g in growths])


class EagleProposer(_FeatureProposer):
    """The EAGLE head drafts from features: its cache holds the pairs (target feature of token t, token
    t + 1) of every committed token; the features the target committed since are pending. A proposal
    feeds the pending pairs of every sequence in one pass (committing them: its last pair's prediction is
    the draft's root), then grows the drafts depth by depth, each depth one head pass over the nodes whose
    children the next depth draws, for all sequences, their K/V written past the committed pairs where their
    descendants read them and the next step's pairs overwrite them (`_deepen`). A chain of K tokens is K
    head passes (the feed and K - 1 nodes) and K output-layer calls, whatever the batch size."""

    kv_shift = 1  # slot s of a row holds the pair (feature of token s, token s + 1)
    WIDE_FEED = 16  # pairs: a feed wider than this (a prompt) computes only each row's last prediction

    def __init__(self, head, vocab_size: int, max_batch_size: int, capacity: int,
                 tree: TreeShape | DynamicTree | None = None, max_depth: int = 8) -> None:
        super().__init__(head, vocab_size, tree, max_depth)
        self.cache = head.new_cache(max_batch_size, capacity + self.max_width(max_depth))
        self.feature_layers = head.config.feature_layers  # EAGLE-3: the target's layers it fuses

    @property
    def memory_bytes(self) -> int:
        return super().memory_bytes + self.cache.nbytes + getattr(self.head.embed, "nbytes", 0)

    # a sequence's state (`seq.draft_state`): [m, H], the head's features of target states not yet paired
    def observe_hidden(self, seq, hidden: torch.Tensor) -> None:
        feats = self.head.features(hidden)  # [m, F] -> [m, H]
        seq.draft_state = feats if seq.draft_state is None else torch.cat([seq.draft_state, feats])

    def cached_tokens(self, seq) -> int:
        """Leading tokens of `seq` that the pairs in the head's cache were made of."""
        n = self.cache.lengths[seq.row]
        return n + 1 if n else 0

    def _start(self, seqs, ks):
        """Feed the pending pairs; a draft starts at each sequence's root, the predicted feature of its last
        token: `Growth.state` [1 + nodes, H] holds the root's, then each node's, as they are computed."""
        roots = self._feed_pending(seqs)  # [H] per sequence, None: no draft
        growths = []
        for seq, k, root in zip(seqs, ks, roots):
            shape = self._shape(k) if root is not None else None
            g = None if shape is None else Growth(seq, self.head, self.vocab, shape, self.guess_kinds > 0)
            if g is not None:
                g.state = root.new_empty(1 + self.max_width(k), root.shape[-1])
                g.state[0] = root
            growths.append(g)
        return growths

    def _frontier_logits(self, growths):
        """One output-layer call for the frontiers of every sequence."""
        return self.head.logits(torch.cat([g.state[[n + 1 for n in g.frontier]] for g in growths]))

    def _deepen(self, seqs, growths):
        """One head pass over the new frontier nodes of every growing draft, all rows together. A node's input
        is its parent's predicted feature and its own token, at position L - 1 + its depth (its row holding L
        committed pairs); its K/V go to slot L + node, where its descendants read them (nothing is committed),
        and it attends the committed pairs, its ancestors and itself in slot order: the keys, in the order,
        that decoding its path one token at a time would give it. A row with fewer nodes repeats its last one
        (the same K/V written again); a row with none writes at slot L, which nothing reads this step."""
        device = self.cache.keys[0].device
        rows = [(self.cache.lengths[seq.row], g, g.frontier if g is not None else []) for seq, g in zip(seqs, growths)]
        width = max(len(nodes) for _, _, nodes in rows)
        S = max(L + (len(g.tokens) if g is not None else 1) for L, g, _ in rows)
        S = -(-S // KEY_BLOCK) * KEY_BLOCK  # whole key blocks (as `attention_inputs` makes them)
        B, H = len(seqs), self.head.config.hidden_size
        feats = torch.zeros(B, width, H, dtype=self.head.dtype, device=device)  # [B, width, H] the parents' predictions
        mask = torch.zeros(B, width, S, dtype=torch.bool, device=device)  # [B, width, S] the slots each node attends
        tokens, positions, slots = [], [], []  # [B][width] each
        for b, (L, g, nodes) in enumerate(rows):
            if not nodes:
                tokens.append([0] * width)
                positions.append([L] * width)
                slots.append([L] * width)
                mask[b, :, L] = True
                continue
            padded = nodes + nodes[-1:] * (width - len(nodes))
            node_depths = depths(g.parents)
            feats[b] = g.state[[g.parents[n] + 1 for n in padded]]
            tokens.append([g.tokens[n] for n in padded])
            positions.append([L - 1 + node_depths[n] for n in padded])
            slots.append([L + n for n in padded])
            mask[b, :, :L] = True
            mask[b, :, L:L + len(g.tokens)] = ancestor_mask(g.parents)[1:, 1:][padded]
        as_tensor = partial(torch.tensor, device=device)
        pred = self.head(feats, as_tensor(tokens), as_tensor(positions), self.cache, mask, as_tensor(slots))  # [B, width, H]
        for b, (_, g, nodes) in enumerate(rows):
            if nodes:
                g.state[[n + 1 for n in nodes]] = pred[b, :len(nodes)]

    def _feed_pending(self, seqs) -> list[torch.Tensor | None]:
        """Feed every row's pending pairs in one pass (right-padded) and commit them; returns each row's root,
        the prediction at its last pair (None: none). A feed wider than `WIDE_FEED` pairs (a prompt) predicts
        at each row's last pair only, the other pairs' K/V written alone (`_feed_wide`)."""
        if [seq.row for seq in seqs] != list(range(len(seqs))):
            raise ValueError("EAGLE expects the running sequences in rows 0..B-1")
        device = self.cache.keys[0].device
        # a prompt's pairs beside other rows are fed in its row alone: padding every row to a prompt's width
        # would write as many slots in each, taking pages that no row needs (and that the scheduler never counted)
        alone = {b: self._feed_row(seq) for b, seq in enumerate(seqs) if len(seqs) > 1 and
                 seq.draft_state is not None and seq.draft_state.shape[0] > self.WIDE_FEED}
        pairs = []
        for seq in seqs:
            start = self.cache.lengths[seq.row]
            feats = seq.draft_state
            m = 0 if feats is None else feats.shape[0]
            pairs.append((start, feats, seq.tokens[start + 1:start + 1 + m]))
        width = max(len(t) for _, _, t in pairs)
        if width == 0:
            return [alone.get(b) for b in range(len(seqs))]
        B, H = len(seqs), self.head.config.hidden_size
        if B == 1:
            feats = pairs[0][1][None]  # [1, width, H]
        else:
            feats = torch.zeros(B, width, H, dtype=self.head.dtype, device=device)
            for b, (_, f, t) in enumerate(pairs):
                if t:
                    feats[b, :len(t)] = f
        as_tensor = partial(torch.tensor, dtype=torch.long, device=device)
        tokens = as_tensor([t + t[-1:] * (width - len(t)) if t else [0] * width for _, _, t in pairs])  # [B, width]
        positions = as_tensor([list(range(start, start + width)) for start, _, _ in pairs])  # [B, width]: their slots
        last = [max(len(t), 1) - 1 for _, _, t in pairs]  # each row's last pair
        end = max(start for start, _, _ in pairs) + width
        if end > self.cache.capacity:
            # padding a row near the end of its context to the widest would overflow: one pass a row
            pred = feats.new_zeros(B, H)
            for b, (start, _, t) in enumerate(pairs):
                if t:
                    view = self.cache.row_view(b)
                    pred[b] = self.head(feats[b:b + 1, :len(t)], tokens[b:b + 1, :len(t)],
                                        positions[b:b + 1, :len(t)], view)[0, -1]
        elif width > self.WIDE_FEED:
            pred = self._feed_wide(feats, tokens, positions, last)
        else:  # causal: a pair attends its row's slots up to its own
            mask = torch.arange(-(-end // KEY_BLOCK) * KEY_BLOCK, device=device) <= positions[..., None]  # [B, width, S]
            pred = self.head(feats, tokens, positions, self.cache, mask, positions)[torch.arange(B), last]  # [B, H]
        roots = []
        for b, (seq, (start, f, t)) in enumerate(zip(seqs, pairs)):
            self.cache.advance(seq.row, len(t))
            seq.draft_state = None
            have_root = self.cache.lengths[seq.row] == len(seq.tokens) - 1 and self.cache.lengths[seq.row] > 0
            roots.append(pred[b] if t and have_root else alone.get(b))
        return roots

    def _feed_row(self, seq) -> torch.Tensor | None:
        """Feed the pending pairs of `seq` (more than `WIDE_FEED`: a prompt's) in its row alone, as a batch of
        one feeds them (`_feed_wide`), and commit them; returns its root (None: none yet)."""
        start, feats = self.cache.lengths[seq.row], seq.draft_state
        n = feats.shape[0]
        as_tensor = partial(torch.tensor, dtype=torch.long, device=feats.device)
        positions = as_tensor([list(range(start, start + n))])
        pred = self._feed_wide(feats[None], as_tensor([seq.tokens[start + 1:start + 1 + n]]), positions, [n - 1],
                               self.cache.row_view(seq.row))[0]
        self.cache.advance(seq.row, n)
        seq.draft_state = None
        return pred if self.cache.lengths[seq.row] == len(seq.tokens) - 1 else None

    def _feed_wide(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   last: list[int], cache: KVCache | None = None) -> torch.Tensor:
        """The predictions [B, H] at pairs `last` of rows feats [B, T, H], tokens and positions [B, T] (pair
        t of a row in the slot of its position): every pair's K/V written alone (`EagleHead.write_kv`), then
        one pass of the last pairs, each attending its row's pairs in slot order, as the causal pass does;
        `cache`: the head's cache (default), or a view of one of its rows."""
        B, cache = tokens.shape[0], self.cache if cache is None else cache
        self.head.write_kv(feats, tokens, positions, cache, positions)
        rows = torch.arange(B, device=tokens.device)
        at = positions[rows, last][:, None]  # [B, 1]
        S = -(-(int(at.max()) + 1) // KEY_BLOCK) * KEY_BLOCK
        mask = (torch.arange(S, device=tokens.device) <= at)[:, None]  # [B, 1, S]
        return self.head(feats[rows, last][:, None], tokens[rows, last][:, None], at, cache, mask, at)[:, 0]

def default_tree(depth: int) -> TreeShape:
    """A small tree for CPUs (each node costs a target row): two guesses at each depth under the
    first-ranked path, e.g. depth 3 -> [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]."""
    choices = []
    for d in range(1, depth + 1):
        choices += [[0] * (d - 1) + [0], [0] * (d - 1) + [1]]
    return TreeShape.from_choices(choices)

