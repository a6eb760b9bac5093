"""Building a proposer from a `SpeculativeConfig`: the one place that maps methods to proposers."""

from __future__ import annotations

from specdec.config import SpeculativeConfig
from specdec.speculative.auto import AutoProposer
from specdec.speculative.auto_heads import AutoHeadsProposer
from specdec.speculative.auto_model import AutoModelProposer
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.draft_model import DraftModelProposer, draft_vocabulary
from specdec.speculative.proposers import NgramProposer, NullProposer, Proposer, SuffixProposer
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
    "draft_model", or "auto" with a draft model) and `heads` (medusa, eagle, or "auto" with heads) are loaded
    by the caller; `vocab_size` is the target's; `special_ids` the tokenizer's special tokens (a draft
    vocabulary keeps them). With suffix drafts beside a drafter (`spec.with_suffix`): an `AutoProposer` (the
    trie alone), `AutoModelProposer` (beside a draft model) or `AutoHeadsProposer` (beside heads)."""
    if spec is None or spec.num_speculative_tokens == 0:
        return NullProposer()
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    if spec.method == "suffix":
        return _suffix(spec)
    if not spec.with_suffix:
        return _single(spec, vocab_size, max_num_seqs, max_model_len, draft_model, heads, special_ids, spec.method)
    k = spec.num_speculative_tokens
    if draft_model is not None:
        model = _single(spec, vocab_size, max_num_seqs, max_model_len, draft_model, None, special_ids, "draft_model")
        return AutoModelProposer(_suffix(spec), model, k, spec.adaptive, "draft_model")
    if heads is not None:
        method = heads.config.method
        second = _single(spec, vocab_size, max_num_seqs, max_model_len, None, heads, special_ids, method)
        return AutoHeadsProposer(_suffix(spec), second, k, method, tree=spec.auto_tree)
    return AutoProposer(_suffix(spec), NullProposer())


def _suffix(spec: SpeculativeConfig) -> SuffixProposer:
    """Suffix decoding: one cache per engine, the requests of a served model sharing it (by salt)."""
    cache = SuffixCache(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                        spec.suffix_decoding_share_unsalted)
    return SuffixProposer(cache, spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                          tree=spec.tree == "dynamic")


def _single(spec: SpeculativeConfig, vocab_size: int, max_num_seqs: int, max_model_len: int, draft_model, heads,
            special_ids, method: str) -> Proposer:
    """A draft model's or heads' proposer alone (`method`: draft_model, medusa or eagle)."""
    k = spec.num_speculative_tokens
    if method == "draft_model":
        vocab = draft_vocabulary(spec.draft_vocab_size, draft_model.config.vocab_size, special_ids)
        return DraftModelProposer(draft_model, max_num_seqs, max_model_len, vocab=vocab)
    if method == "medusa":
        return MedusaProposer(heads, vocab_size, tree_of(spec), max_depth=k)
    if method == "eagle":
        return EagleProposer(heads, vocab_size, max_num_seqs, max_model_len, tree_of(spec), max_depth=k)
    raise ValueError(f"speculative method {method!r} is not available yet")
