"""Proposers: n-gram lookup tables, the draft-model proposer's drafts and cache rollback, and the
draft/target compatibility check."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, varied_model
from specdec.config import ModelConfig, SamplingParams
from specdec.sampling import make_generator
from specdec.speculative.acceptance import Verdict
from specdec.speculative.compat import IncompatibleDraftError, check_draft_compatible
from specdec.speculative.draft_model import DraftModelProposer, draft_vocabulary
from specdec.speculative.proposers import Draft, NgramProposer


_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)


@dataclass
class Seq:
    tokens: list[int]
    row: int = 0
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))
    generator: torch.Generator = field(default_factory=lambda: make_generator(0))
    matcher: object = None
    draft_state: object = None


# ------------------------------------------------------------------------------------------- n-gram
NGRAM_TABLE = [
    # (name, context, max_n, min_n, k, expected draft)
    ("docstring example", [1, 2, 3, 9, 1, 2], 2, 1, 3, [3, 9, 1]),
    ("continuation may run into the suffix", [1, 2, 3, 9, 1, 2], 2, 1, 10, [3, 9, 1, 2]),
    # [5 6 7] occurs at 0 (-> 8); the 1-gram [7] occurs more recently at 5 (-> 9): the longest match wins
    ("longest match first", [5, 6, 7, 8, 0, 7, 9, 5, 6, 7], 3, 1, 2, [8, 0]),
    ("shorter n when the longest has no match", [5, 6, 7, 8, 0, 7, 9, 4, 6, 7], 3, 1, 2, [8, 0]),
    ("only the 1-gram matches", [5, 6, 7, 8, 0, 7, 9, 4, 3, 7], 3, 1, 2, [9, 4]),
    ("max_n caps the match length", [5, 6, 7, 8, 0, 7, 9, 5, 6, 7], 1, 1, 2, [9, 5]),
    ("most recent occurrence", [1, 2, 3, 1, 2, 4, 1, 2], 2, 1, 3, [4, 1, 2]),
    ("most recent occurrence, 1-gram", [4, 8, 4, 9, 4], 1, 1, 1, [9]),
    ("no match: empty draft", [1, 2, 3, 4, 5], 4, 1, 3, []),
    ("min_n rejects shorter matches", [5, 6, 7, 8, 0, 7, 9, 4, 3, 7], 3, 2, 2, []),
    ("k limits the draft", [1, 2, 3, 4, 5, 6, 1, 2], 2, 1, 1, [3]),
    ("k = 0: empty", [1, 2, 3, 1, 2], 2, 1, 0, []),
    ("overlapping match in a run", [3, 3, 3, 3], 2, 1, 4, [3]),
    ("one token: nothing earlier", [7], 4, 1, 3, []),
    ("two equal tokens", [7, 7], 4, 1, 3, [7]),
    ("context shorter than max_n", [1, 2, 1], 4, 1, 2, [2, 1]),
]


@pytest.mark.parametrize("name,context,max_n,min_n,k,expected", NGRAM_TABLE, ids=[c[0] for c in NGRAM_TABLE])
def test_ngram_lookup(name, context, max_n, min_n, k, expected):
    assert NgramProposer(max_n=max_n, min_n=min_n).lookup(context, k) == expected


def test_ngram_propose_is_batch_first_and_point_mass():
    proposer = NgramProposer(max_n=2)
    seqs = [Seq([1, 2, 3, 1, 2]), Seq([4, 5, 6], row=1), Seq([9, 9, 8, 9], row=2)]
    drafts = proposer.propose(seqs, [2, 3, 0]).drafts
    assert drafts == [Draft([3, 1]), Draft([]), Draft([])]
    assert all(d.probs is None for d in drafts)
    proposer.observe(seqs, drafts, [Verdict(1, 0)] * 3)  # no memory: observing changes nothing
    assert proposer.propose(seqs, [2, 3, 0]).drafts == drafts
    assert proposer.memory_bytes == 0


# ------------------------------------------------------------------------------------------- draft model
@pytest.fixture(scope="module")
def draft_model():
    with torch.inference_mode():
        return varied_model(seed=5)


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """Reference: the model's greedy continuation, one token per full forward without a cache reuse."""
    tokens = list(prompt)
    for _ in range(n):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, num_logits=1)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def continuation_at(model, context: list[int], start: int, k: int, forward=None) -> list[int]:
    """What `model` drafts after `context` placed at positions start.. (a fresh cache), greedily."""
    forward = forward or model
    cache = model.new_cache(1, 64)
    logits = forward(torch.tensor([context]), torch.arange(start, start + len(context))[None], cache)
    out = [int(logits[0, -1].argmax())]
    cache.advance(0, len(context))
    for i in range(k - 1):
        logits = forward(torch.tensor([[out[-1]]]), torch.tensor([[start + len(context) + i]]), cache)
        cache.advance(0, 1)
        out.append(int(logits[0, -1].argmax()))
    return out


def test_draft_model_greedy_draft_and_rollback(draft_model):
    prompt = [1, 2, 3, 4, 5, 6, 7]
    ref = greedy_continuation(draft_model, prompt, 12)
    proposer = DraftModelProposer(draft_model, max_batch_size=2, capacity=64)
    seq = Seq(list(prompt))

    draft = proposer.propose([seq], [4]).drafts[0]
    assert draft.tokens == ref[:4] and draft.probs is None
    n = len(prompt)
    assert proposer.cache.lengths[0] == n + 3  # prompt, then drafted tokens 0..2 fed (3 is never fed)

    # two accepted, then the target recovers ref[2] (here it agrees with the draft's own choice)
    proposer.observe([seq], [draft], [Verdict(2, ref[2])])
    assert proposer.cache.lengths[0] == n + 2  # rolled back to the kept tokens
    seq.tokens += ref[:3]
    draft = proposer.propose([seq], [3]).drafts[0]
    assert draft.tokens == ref[3:6]

    # everything accepted: the last drafted token and the bonus token are both fed next time
    proposer.observe([seq], [draft], [Verdict(3, ref[6])])
    assert proposer.cache.lengths[0] == len(seq.tokens) + 2  # the 3rd drafted token was never fed
    seq.tokens += ref[3:7]
    draft = proposer.propose([seq], [2]).drafts[0]
    assert draft.tokens == ref[7:9]

    # a rejection at the first position: the recovered token differs from the draft's own choice
    proposer.observe([seq], [draft], [Verdict(0, (ref[7] + 1) % 97)])
    assert proposer.cache.lengths[0] == len(seq.tokens)
    seq.tokens += [(ref[7] + 1) % 97]
    draft = proposer.propose([seq], [2]).drafts[0]
    assert draft.tokens == greedy_continuation(draft_model, seq.tokens, 2)


def test_draft_model_catches_up_after_steps_without_drafting(draft_model):
    prompt = [3, 1, 4, 1, 5]
    proposer = DraftModelProposer(draft_model, max_batch_size=1, capacity=64, prefill_chunk=2)
    seq = Seq(list(prompt))
    draft = proposer.propose([seq], [1]).drafts[0]
    proposer.observe([seq], [draft], [Verdict(0, 9)])
    # five tokens decoded without the draft model (K = 0 steps): it must catch up in one proposal
    seq.tokens += [9, 2, 6, 5, 3, 5]
    assert proposer.propose([seq], [0]).drafts == [Draft([])]
    proposer.observe([seq], [Draft([])], [Verdict(0, 8)])  # a step it did not draft is ignored
    seq.tokens.append(8)
    draft = proposer.propose([seq], [3]).drafts[0]
    assert draft.tokens == greedy_continuation(draft_model, seq.tokens, 3)


def test_a_row_far_behind_restarts_on_the_last_window(draft_model):
    """A row more than `window` tokens behind restarts on the last `window` tokens (at their true
    positions), so it costs a short prefill, not one of everything decoded without the draft; it then
    drafts what the draft says given that window, and later steps go on from there (rollback included).
    A row at most `window` behind is fed all it lacks."""
    fed = []
    original = draft_model.forward

    def counting(tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return original(tokens, *args, **kwargs)

    def continuation(context, start, k):
        return continuation_at(draft_model, context, start, k, forward=original)  # uncounted

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 96, (40,), generator=gen).tolist()
    proposer = DraftModelProposer(draft_model, max_batch_size=1, capacity=64, window=8)
    draft_model.forward = counting
    try:
        seq = Seq(list(tokens))
        proposal = proposer.propose([seq], [1])
        draft = proposal.drafts[0]
        assert fed == [8 + 1]  # the window and the last token, in one forward (not 40)
        assert seq.draft_state.skipped == 39 - 8 and proposer.cache.lengths[0] == 9
        assert proposal.forward_seconds is None  # a catch-up forward is not the cost of a drafting step
        assert draft.tokens == continuation(tokens[-9:], 31, 1)
        proposer.observe([seq], [draft], [Verdict(1, 5)])  # accepted + bonus 5
        seq.tokens += [draft.tokens[0], 5]
        fed.clear()
        proposal = proposer.propose([seq], [2])
        draft = proposal.drafts[0]
        assert fed == [2, 1] and proposal.forward_seconds > 0
        assert draft.tokens == continuation(seq.tokens[-11:], 31, 2)
        # 8 tokens decoded without the draft (<= window): all fed, in the first forward
        proposer.observe([seq], [draft], [Verdict(0, 6)])
        seq.tokens += [6] + tokens[:7]
        fed.clear()
        draft = proposer.propose([seq], [1]).drafts[0]
        assert fed == [8] and seq.draft_state.skipped == 31
        assert draft.tokens == continuation(seq.tokens[31:], 31, 1)
    finally:
        draft_model.forward = original


def test_observe_after_a_step_without_drafting_leaves_the_rows_alone(draft_model):
    """The engine observes every step, also one without drafting (no proposal). A sequence that moved into
    a row since the last draft must not be rolled back with that row's last draft (regression: "cannot
    truncate row 1 of length 17 to -17" under load, a moved-in row truncated with the last occupant's
    length minus its own skipped tokens)."""
    proposer = DraftModelProposer(draft_model, max_batch_size=2, capacity=64, window=4)
    a, b = Seq(list(range(1, 11)), row=0), Seq(list(range(20, 50)), row=1)
    drafts = proposer.propose([a, b], [1, 1]).drafts  # b restarts on a window: 25 tokens skipped
    proposer.observe([a, b], drafts, [Verdict(0, 7), Verdict(0, 8)])
    a.tokens.append(7)
    b.tokens.append(8)
    assert b.draft_state.skipped == 25
    length = proposer.cache.lengths[1]
    proposer.release(a)  # a finished; b takes its row (the engine moves it, and frees row 1)
    proposer.cache.move_row(1, 0)
    proposer.cache.clear(1)
    b.row = 0
    proposer.observe([b], [Draft([])], [Verdict(0, 9)])  # a step without drafting
    assert proposer.cache.lengths[0] == length and b.draft_state.skipped == 25
    b.tokens.append(9)
    assert proposer.propose([b], [2]).drafts[0].tokens == continuation_at(draft_model, b.tokens[25:], 25, 2)


def test_draft_model_reads_the_prompt_at_prefill(draft_model):
    """`prefill` feeds the chunks the target is fed; the first proposal then feeds only the last prompt
    token. A row that missed a chunk ignores later ones (it catches up at its first proposal)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    proposer = DraftModelProposer(draft_model, max_batch_size=2, capacity=64, prefill_chunk=5, window=4)
    seq = Seq(list(prompt), row=1)
    proposer.prefill(seq, 0, 10)
    proposer.prefill(seq, 10, len(prompt) - 1)
    assert proposer.cache.lengths[1] == len(prompt) - 1 and seq.draft_state.skipped == 0
    draft = proposer.propose([Seq([0]), seq], [1, 3]).drafts[1]
    assert draft.tokens == greedy_continuation(draft_model, prompt, 3)  # the whole prompt as context
    other = Seq(list(prompt), row=0)
    proposer.cache.clear(0)
    proposer.prefill(other, 10, 20)  # the row is not at 10: nothing fed
    assert proposer.cache.lengths[0] == 0


def test_draft_model_batch_rows_and_per_sequence_k(draft_model):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], [7, 7, 7, 7, 7]]
    proposer = DraftModelProposer(draft_model, max_batch_size=3, capacity=64)
    seqs = [Seq(list(p), row=i) for i, p in enumerate(prompts)]
    drafts = proposer.propose(seqs, [3, 1, 0]).drafts
    assert [len(d.tokens) for d in drafts] == [3, 1, 0]
    # a row grows only by the drafted tokens it feeds (k - 1); the others ride along uncommitted
    assert proposer.cache.lengths[:3] == [len(prompts[0]) + 2, len(prompts[1]), len(prompts[2])]
    for seq, draft in zip(seqs, drafts):
        assert draft.tokens == greedy_continuation(draft_model, seq.tokens, len(draft.tokens))
    proposer.observe(seqs, drafts, [Verdict(3, 11), Verdict(0, 12), Verdict(0, 13)])
    for seq, draft, nxt in zip(seqs, drafts, (11, 12, 13)):
        seq.tokens += draft.tokens + [nxt] if seq.row == 0 else [nxt]
    drafts = proposer.propose(seqs, [2, 2, 2]).drafts
    for seq, draft in zip(seqs, drafts):
        assert draft.tokens == greedy_continuation(draft_model, seq.tokens, 2)
    # the engine keeps rows packed: row 2 moves to row 0 when the sequence in row 0 finishes
    proposer.observe(seqs, drafts, [Verdict(0, 21), Verdict(0, 22), Verdict(0, 23)])
    for seq, nxt in zip(seqs, (21, 22, 23)):
        seq.tokens.append(nxt)
    proposer.release(seqs[0])
    proposer.cache.move_row(2, 0)
    proposer.cache.clear(2)
    assert proposer.cache.lengths[2] == 0
    moved = seqs[2]
    moved.row = 0
    assert proposer.propose([moved, seqs[1]], [2, 1]).drafts[0].tokens == greedy_continuation(draft_model, moved.tokens, 2)


def test_draft_model_sampling_returns_processed_probs(draft_model):
    params = SamplingParams(temperature=0.8, top_k=10, seed=3)
    proposer = DraftModelProposer(draft_model, max_batch_size=1, capacity=64)
    drafts = []
    for _ in range(2):
        proposer.cache.clear(0)
        seq = Seq([1, 2, 3], params=params, generator=make_generator(3))
        drafts.append(proposer.propose([seq], [4]).drafts[0])
    draft = drafts[0]
    assert draft.probs.shape == (4, 97)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4))
    assert bool(((draft.probs > 0).sum(-1) == 10).all())  # top-k applied
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert drafts[1].tokens == draft.tokens and torch.equal(drafts[1].probs, draft.probs)  # seeded
    assert proposer.memory_bytes > proposer.cache.nbytes > 0


def test_draft_vocabulary_is_the_first_ids_and_the_special_ones():
    assert draft_vocabulary(None, 97, [90]) is None and draft_vocabulary(97, 97, [90]) is None
    assert draft_vocabulary(4, 97, [90, 2, 200]).tolist() == [0, 1, 2, 3, 90]  # 200: not a token of 97


def test_a_draft_vocabulary_drafts_the_best_of_its_tokens_and_samples_only_them(draft_model):
    """Greedy: each drafted token is the draft's argmax over the vocabulary's tokens (its logits there are the
    bits of the whole lm_head's); sampling: the reported distribution is zero outside them and sums to 1."""
    vocab = draft_vocabulary(40, 97, [90])
    proposer = DraftModelProposer(draft_model, max_batch_size=1, capacity=64, vocab=vocab)
    outside = torch.ones(97, dtype=torch.bool)
    outside[vocab] = False

    def restricted(*args, **kw):  # the draft with every other token's logit at -inf
        return draft_model(*args, **kw).masked_fill(outside, float("-inf"))

    prompt = [1, 2, 3, 4, 5, 6, 7]
    draft = proposer.propose([Seq(list(prompt))], [6]).drafts[0]
    assert draft.tokens == continuation_at(draft_model, prompt, 0, 6, forward=restricted)
    assert draft.tokens != continuation_at(draft_model, prompt, 0, 6)  # the restriction mattered here
    assert proposer.memory_bytes > DraftModelProposer(draft_model, 1, 64).memory_bytes  # the rows' copy counts

    params = SamplingParams(temperature=0.8, seed=3)
    proposer.cache.clear(0)
    sampled = proposer.propose([Seq([1, 2, 3], params=params, generator=make_generator(3))], [4]).drafts[0]
    assert sampled.probs.shape == (4, 97) and torch.allclose(sampled.probs.sum(-1), torch.ones(4))
    assert bool((sampled.probs[:, outside] == 0).all()) and bool((sampled.probs[:, vocab] > 0).all())
    assert all(t in vocab.tolist() for t in sampled.tokens)


class OnlyTokens:
    """A grammar matcher that allows only `allowed` tokens, whatever came before."""

    def __init__(self, allowed: list[int], vocab_size: int = 97) -> None:
        self.mask = torch.zeros(1, vocab_size, dtype=torch.bool)
        self.mask[0, allowed] = True

    def masks_along(self, tokens):
        return self.mask, 1


def test_a_draft_vocabulary_without_any_token_the_grammar_allows_proposes_allowed_ones(draft_model):
    """Under a grammar that allows none of the vocabulary's tokens, the draft proposes the grammar's tokens,
    uniformly (its distribution stays a distribution: rejection sampling needs one)."""
    proposer = DraftModelProposer(draft_model, max_batch_size=1, capacity=64, vocab=draft_vocabulary(40, 97, []))
    greedy = proposer.propose([Seq([1, 2, 3], matcher=OnlyTokens([90, 91]))], [2]).drafts[0]
    assert set(greedy.tokens) <= {90, 91}
    proposer.cache.clear(0)
    params = SamplingParams(temperature=0.8, seed=3)
    sampled = proposer.propose([Seq([1, 2, 3], params=params, generator=make_generator(3),
                                    matcher=OnlyTokens([90, 91]))], [2]).drafts[0]
    assert set(sampled.tokens) <= {90, 91}
    assert torch.allclose(sampled.probs[:, [90, 91]], torch.full((2, 2), 0.5)) and sampled.probs.sum() == 2


# ------------------------------------------------------------------------------------------- compatibility
def config(vocab_size: int = 97) -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_compatible_pair_passes():
    check_draft_compatible(FakeTokenizer(), FakeTokenizer(), config(), config())


def test_padded_embedding_is_fine():
    # the target's embedding is padded to 128 rows, the draft's to 112: both cover the 97 ids
    check_draft_compatible(FakeTokenizer(), FakeTokenizer(), config(128), config(112))


@pytest.mark.parametrize(
    "draft_tok,draft_vocab,message",
    [
        (FakeTokenizer(vocab_size=90, eos_token_ids=(89,)), 97,
         "vocabularies differ (97 vs 90 tokens: 7 only in the target"),
        # id 3 renamed, and id 4 named as the target's id 3
        (FakeTokenizer(names={3: "<x>", 4: "<3:d>"}), 97,
         "vocabularies differ (97 vs 97 tokens: 1 only in the target, 1 only in the draft, 1 with different ids)"),
        (FakeTokenizer(eos_token_ids=(95,)), 97, "eos_token_ids differs (target (96,), draft (95,))"),
        (FakeTokenizer(bos_token_id=0), 97, "bos_token_id differs (target None, draft 0)"),
        (FakeTokenizer(pad_token_id=1), 97, "pad_token_id differs (target None, draft 1)"),
        (FakeTokenizer(), 64, "the draft's embedding has 64 rows but the tokenizer uses ids up to 96"),
    ],
    ids=["different vocab size", "remapped ids", "different eos", "different bos", "different pad",
         "embedding too small"],
)
def test_mismatch_is_rejected_with_what_differs(draft_tok, draft_vocab, message):
    with pytest.raises(IncompatibleDraftError) as info:
        check_draft_compatible(FakeTokenizer(), draft_tok, config(), config(draft_vocab))
    assert message in str(info.value)
    assert str(info.value).startswith("the draft model cannot serve this target")


def test_every_difference_is_reported():
    draft_tok = FakeTokenizer(vocab_size=90, eos_token_ids=(89,))
    with pytest.raises(IncompatibleDraftError) as info:
        check_draft_compatible(FakeTokenizer(), draft_tok, config(), config(90))
    text = str(info.value)
    assert "vocabularies differ" in text and "eos_token_ids differs (target (96,), draft (89,))" in text
    assert isinstance(info.value, ValueError)
