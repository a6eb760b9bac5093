"""Can this draft model serve this target? Same tokenizer, or the drafts mean nothing to the target."""

from __future__ import annotations

from specdec.config import ModelConfig


class IncompatibleDraftError(ValueError):
    pass


def check_draft_compatible(target_tokenizer, draft_tokenizer, target_config: ModelConfig,
                           draft_config: ModelConfig) -> None:
    """Raise IncompatibleDraftError saying what differs, unless both tokenizers map the same strings to
    the same ids and agree on special tokens. Embedding tables may be padded to different sizes as long
    as every id the tokenizer can produce exists in both models."""
    problems = []
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(target_vocab.keys() - draft_vocab.keys())
        only_draft = len(draft_vocab.keys() - target_vocab.keys())
        remapped = sum(1 for t, i in target_vocab.items() if t in draft_vocab and draft_vocab[t] != i)
        problems.append(
            f"vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} tokens: {only_target} only in the "
            f"target, {only_draft} only in the draft, {remapped} with different ids)"
        )
    for name in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        t, d = getattr(target_tokenizer, name), getattr(draft_tokenizer, name)
        if t != d:
            problems.append(f"{name} differs (target {t}, draft {d})")
    needed = max(target_vocab.values(), default=0) + 1
    for who, config in (("target", target_config), ("draft", draft_config)):
        if config.vocab_size < needed:
            problems.append(f"the {who}'s embedding has {config.vocab_size} rows but the tokenizer uses ids up to {needed - 1}")
    if problems:
        raise IncompatibleDraftError("the draft model cannot serve this target: " + "; ".join(problems))
