"""Building a proposer from a `SpeculativeConfig`: the one place that maps methods to proposers."""

from __future__ import annotations

from specdec.config import SpeculativeConfig
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.proposers import (DraftModelProposer, NgramProposer, NullProposer, Proposer, SuffixProposer,
                                          draft_vocabulary)
from specdec.speculative.suffix import SuffixCache
from specdec.speculative.tree import DynamicTree, TreeShape


def tree_of(spec: SpeculativeConfig) -> TreeShape | DynamicTree | None:
    """The tree a heads method drafts (None: a chain)."""
    if spec.tree is None:
        return None
    if spec.tree == "default":
        return default_tree(spec.num_speculative_tokens)
    if spec.tree == "dynamic":
        return DynamicTree(spec.tree_top_k, spec.tree_beam)
    return TreeShape.from_choices(spec.tree)


def build_proposer(spec: SpeculativeConfig | None, *, vocab_size: int, max_num_seqs: int, max_model_len: int,
                   draft_model=None, heads=None, special_ids=()) -> Proposer:
    """The proposer `spec` asks for (the `NullProposer` for None or K = 0). `draft_model` (method
    "draft_model") and `heads` (medusa, eagle) are loaded by the caller; `vocab_size` is the target's;
    `special_ids` the tokenizer's special tokens (a draft vocabulary keeps them)."""
    if spec is None or spec.num_speculative_tokens == 0:
        return NullProposer()
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    if spec.method == "suffix":  # one cache per engine: the requests of a served model share it
        cache = SuffixCache(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests)
        return SuffixProposer(cache, spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                              tree=spec.tree == "dynamic")
    if spec.method == "draft_model":
        vocab = draft_vocabulary(spec.draft_vocab_size, draft_model.config.vocab_size, special_ids)
        return DraftModelProposer(draft_model, max_num_seqs, max_model_len, vocab=vocab)
    if spec.method == "medusa":
        return MedusaProposer(heads, vocab_size, tree_of(spec), max_depth=k)
    if spec.method == "eagle":
        return EagleProposer(heads, vocab_size, max_num_seqs, max_model_len, tree_of(spec), max_depth=k)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")
