"""Building a proposer from a `SpeculativeConfig`: each method's builder (named by its record in
`specdec.methods`), and the drafters beside the suffix tries."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specdec.config import SpeculativeConfig
from specdec.methods import METHODS, Method, resolve
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


@dataclass(frozen=True)
class BuildInputs:
    """What a method's builder gets beside the config: the target's vocabulary, the engine's limits, the weights
    `load_drafters` loaded (a draft model, or heads) and the tokenizer's special tokens."""

    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    draft_model: Any = None
    heads: Any = None
    special_ids: Any = ()


def build_proposer(spec: SpeculativeConfig | None, *, vocab_size: int, max_num_seqs: int, max_model_len: int,
                   draft_model=None, heads=None, special_ids=()) -> Proposer:
    """The proposer `spec` asks for (the `NullProposer` for None or K = 0). `draft_model` (method
    "draft_model", or "auto" with a draft model) and `heads` (medusa, eagle, or "auto" with heads) are loaded
    by the caller; `vocab_size` is the target's; `special_ids` the tokenizer's special tokens (a draft
    vocabulary keeps them). A method alone: its record's builder (`specdec.methods`). With suffix drafts beside
    a drafter (`spec.with_suffix`): an `AutoProposer` (the trie alone), `AutoModelProposer` (beside a draft
    model) or `AutoHeadsProposer` (beside heads), the second drafter built by its own method's builder."""
    if spec is None or spec.num_speculative_tokens == 0:
        return NullProposer()
    inputs = BuildInputs(vocab_size, max_num_seqs, max_model_len, draft_model, heads, special_ids)
    if not spec.with_suffix:
        return _build(spec.record, spec, inputs)
    k = spec.num_speculative_tokens
    if draft_model is not None:
        model = _build(METHODS["draft_model"], spec, replace(inputs, heads=None))
        return AutoModelProposer(_suffix(spec), model, k, spec.adaptive, "draft_model")
    if heads is not None:
        name = heads.config.method
        second = _build(METHODS[name], spec, replace(inputs, draft_model=None))
        return AutoHeadsProposer(_suffix(spec), second, k, name, tree=spec.auto_tree)
    return AutoProposer(_suffix(spec), NullProposer())


def _build(record: Method, spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    if record.builder is None:
        raise ValueError(f"speculative method {record.name!r} drafts only beside the suffix tries")
    return resolve(record.builder)(spec, inputs)


def _suffix(spec: SpeculativeConfig) -> SuffixProposer:
    """Suffix decoding: one cache per engine, the requests of a served model sharing it (by salt)."""
    cache = SuffixCache(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                        spec.suffix_decoding_share_unsalted)
    return SuffixProposer(cache, spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                          tree=spec.tree == "dynamic")


# the methods' builders, named by their records (`Method.builder`): each takes the config and `BuildInputs`

def build_ngram(spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


def build_suffix(spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    return _suffix(spec)


def build_draft_model(spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    model = inputs.draft_model
    vocab = draft_vocabulary(spec.draft_vocab_size, model.config.vocab_size, inputs.special_ids)
    return DraftModelProposer(model, inputs.max_num_seqs, inputs.max_model_len, vocab=vocab)


def build_medusa(spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    return MedusaProposer(inputs.heads, inputs.vocab_size, tree_of(spec), max_depth=spec.num_speculative_tokens)


def build_eagle(spec: SpeculativeConfig, inputs: BuildInputs) -> Proposer:
    return EagleProposer(inputs.heads, inputs.vocab_size, inputs.max_num_seqs, inputs.max_model_len, tree_of(spec),
                         max_depth=spec.num_speculative_tokens)
