"""Auto speculation on tiny random models: greedy output equal to plain decoding's with the trie alone
(`AutoProposer`), beside a draft model (`AutoModelProposer`, fixed and adaptive K) and beside Medusa heads
(`AutoHeadsProposer`), in batches joining and leaving, with chunked prefill and with prefix caching; the
trie's draft taken where it is sure and the second drafter's where it knows nothing; no drafting where no
draft can pay; seeded sampling reproducible and following the target's distribution; the default
speculation of `LLM` and its flags."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread
from specdec.api import build_speculative_config
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import Engine
from specdec.engine.metrics import DrafterCounts
from specdec.heads.files import load_heads
from specdec.sampling import process_logits
from specdec.speculative.auto import AutoProposer
from specdec.speculative.auto_heads import AutoHeadsProposer
from specdec.speculative.auto_model import AutoModelProposer
from specdec.speculative.costs import CostModel
from specdec.speculative.head_proposers import MedusaProposer
from specdec.speculative.draft_model import DraftModelProposer
from specdec.speculative.proposers import Draft, NullProposer, SuffixProposer
from specdec.speculative.suffix import SuffixCache
from test_engine_tiny import (BATCH_REQUESTS, GREEDY, MAX_LEN, PROMPTS, SpeculationPays, assert_metrics_consistent,
                              draft, generate, plain, run, target)
from test_sampling_distribution import assert_follows
from test_suffix import assert_first_two_follow_the_target

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

DEPTH = 24  # the trie's, and the engine's K: a suffix draft may be that long


def auto_engine(second: str | None = None, k: int = 3, adaptive: bool = True, batch: int = 1, share: bool = False,
                costs: CostModel | None = None, **engine_kw) -> Engine:
    """The trie beside `second` ("noisy copy", "self", "other seed": a draft model; None: the trie alone)."""
    suffix = SuffixProposer(SuffixCache(DEPTH, 100, share_unsalted=share))
    proposer = AutoProposer(suffix, NullProposer())
    if second is not None:
        window = MAX_LEN if second == "self" else 16
        drafter = DraftModelProposer(draft("fp32", second), batch, MAX_LEN, window=window)
        proposer = AutoModelProposer(suffix, drafter, k, adaptive, "draft_model")
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=DEPTH, max_model_len=MAX_LEN,
                    max_batch_size=batch, **engine_kw)
    engine.controller.costs = costs or SpeculationPays()  # choices that do not depend on this machine's speed
    return engine


SECONDS = [(None, 3, True), ("noisy copy", 4, False), ("noisy copy", 5, True), ("self", 3, False),
           ("other seed", 2, True)]


@pytest.mark.parametrize("second,k,adaptive", SECONDS)
def test_greedy_auto_equals_plain(second, k, adaptive):
    engine = auto_engine(second, k, adaptive, share=True)  # later prompts draft from earlier outputs too
    accepted = 0
    for prompt in PROMPTS + PROMPTS:
        out = generate(engine, prompt, GREEDY)
        assert tuple(out.token_ids) == plain("fp32", prompt)
        assert_metrics_consistent(out)
        accepted += out.metrics.num_accepted_tokens
        counts = out.metrics.drafters
        assert sum(c.drafts for c in counts.values()) == out.metrics.num_drafts  # every draft has its drafter
        assert set(counts) <= {"suffix", "draft_model"}
    assert accepted > 0


@pytest.mark.parametrize("second,k,adaptive", SECONDS)
def test_auto_in_a_batch_with_chunked_prefill_equals_plain(second, k, adaptive):
    """Three rows, six requests joining at different steps and leaving as they finish, prompts fed 3 tokens a
    step: every output is its own plain one."""
    engine = auto_engine(second, k, adaptive, batch=3, prefill_chunk=3)
    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in BATCH_REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in BATCH_REQUESTS])
    for rid, prompt, n, _ in BATCH_REQUESTS:
        assert tuple(finals[rid].token_ids) == plain("fp32", prompt, 40)[:n], f"request {rid}"
        assert_metrics_consistent(finals[rid])


@pytest.mark.parametrize("second", [None, "noisy copy"])
def test_auto_with_prefix_caching_equals_plain(second):
    """A prompt sent again starts from its cached blocks (the target's, and the draft model's): the same output,
    and the second time its prefix was not prefilled."""
    prompt = tuple(range(3, 40))
    engine = auto_engine(second, 4, True, prefix_cache_blocks=32, prefix_block_size=4)
    first, second_out = generate(engine, prompt, GREEDY), generate(engine, prompt, GREEDY)
    assert first.token_ids == second_out.token_ids == list(plain("fp32", prompt))
    assert first.metrics.cached_tokens == 0 and second_out.metrics.cached_tokens >= 32


def test_the_trie_is_taken_where_it_is_sure_and_the_draft_model_elsewhere():
    """A draft model that always agrees ("self", K = 2) beside the trie: on a first answer the trie knows little
    (what the answer has repeated of itself so far) and the draft model drafts where it knows nothing; the same
    prompt again (the trie holds the first answer, sure of every token) is drafted by the trie, many tokens a
    pass."""
    engine = auto_engine("self", 2, False, share=True)
    prompt = PROMPTS[2]  # no repeats: the trie has little to go on the first time
    first, second = generate(engine, prompt, GREEDY), generate(engine, prompt, GREEDY)
    assert first.token_ids == second.token_ids == list(plain("fp32", prompt))
    used = {name: c.accepted for name, c in first.metrics.drafters.items()}  # accepted tokens by drafter
    assert used.get("draft_model", 0) >= 6 and used.get("suffix", 0) > 0, first.metrics.to_dict()
    again = {name: c.accepted for name, c in second.metrics.drafters.items()}
    assert again.get("suffix", 0) >= 30 and again.get("suffix", 0) > again.get("draft_model", 0), again
    assert second.metrics.target_passes <= 8, second.metrics.to_dict()


class RowsCostFull(CostModel):
    """Every row of a pass costs a whole pass, and a draft forward half of one: no draft can pay."""

    def __init__(self) -> None:
        super().__init__()
        self.draft, self.verify = {1: 0.5}, {1: 1.0, 64: 64.0}
        self.prefill = {"target": 0.01, "draft": 0.005}

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        pass

    def record_verify(self, rows: int, seconds: float) -> None:
        pass


def test_nothing_is_drafted_where_no_draft_can_pay():
    """With every extra row as dear as a pass, the plain step wins every value: the trie's drafts are cut to
    nothing and the draft model only probes now and then (16 steps, then 32, ...): output exact."""
    engine = auto_engine("noisy copy", 4, True, costs=RowsCostFull())
    for prompt in PROMPTS:
        out = generate(engine, prompt, GREEDY)
        assert tuple(out.token_ids) == plain("fp32", prompt)
        assert out.metrics.num_drafts <= 2, out.metrics.to_dict()
        assert set(out.metrics.drafters) <= {"draft_model"}
        assert all(c.draft_tokens == c.drafts for c in out.metrics.drafters.values())  # probes draft one token


def test_a_row_whose_trie_drafts_are_not_verified_relaxes_its_lean_each_step():
    """AutoProposer's rows: a step whose draft holds no labelled token (none, or a draft model's) decays the
    row's lean toward 1, as a learning step does, so a row cut for early misses drafts from the trie again."""

    class Seq:
        request_id = "r"

    class Trie:  # only what `AutoProposer` asks of the trie here
        guess_kinds = 20

        def observe(self, *args) -> None:
            pass

    auto, seq = AutoProposer(Trie(), NullProposer()), Seq()
    row = auto._row(seq)
    row.lean.kind_accepted, row.lean.kind_expected = 0.0, 1.8  # two 1-token misses at ~0.9
    before = row.lean.lean
    for _ in range(10):
        auto.observe([seq], [Draft([])], [None])
    assert row.lean.kind_expected == pytest.approx(1.8 * 0.95 ** 10) and before < row.lean.lean < 1.0


def test_a_fixed_k_draft_model_drafts_k_tokens_where_it_pays_and_nothing_where_no_draft_can():
    """--num-speculative-tokens K fixes the draft model's K: each of its drafts holds K tokens (fewer only where
    fewer remain to emit). It drafts where that is worth more than the trie's draft and plain decoding: where no
    draft can pay (every extra row as dear as a pass) it neither drafts, nor probes, nor reads a prompt."""
    pays = auto_engine("noisy copy", 3, False)
    never = auto_engine("noisy copy", 3, False, costs=RowsCostFull())
    reads = []
    read = never.proposer.second.prefill
    never.proposer.second.prefill = lambda seq, start, stop: reads.append(stop - start) or read(seq, start, stop)
    for prompt in PROMPTS:
        out = generate(pays, prompt, GREEDY)
        assert tuple(out.token_ids) == plain("fp32", prompt)
        drafts, drafted, _ = out.metrics.drafters["draft_model"]
        # K = 3 but in the last steps, which may draft only 2, then 1 (a draft leaves a token to emit)
        assert drafts > 0 and drafted >= 3 * drafts - (1 + 2), out.metrics.to_dict()
        out = generate(never, prompt, GREEDY)
        assert tuple(out.token_ids) == plain("fp32", prompt)
        assert out.metrics.num_drafts == 0 and not out.metrics.drafters, out.metrics.to_dict()
    assert reads == []
    # the share of steps the model drafted in (what a prompt's reading can pay off on) follows its wins
    assert never.proposer.share < 0.01 < 0.3 < pays.proposer.share


def test_the_draft_model_reads_a_prompt_only_where_drafting_repays_the_reading():
    """Before its costs are measured it reads nothing (it drafts from a short window, and measures); then it
    reads a joining prompt when drafting at the acceptance measured on read prompts beats plain decoding by
    more, over the share of the request's max_tokens it has lately drafted (not the trie), than the reading
    costs."""
    engine = auto_engine("noisy copy", 3, False)
    auto = engine.proposer
    engine.controller.costs = CostModel()
    assert not auto.reading_pays(1, 100, 64)  # nothing measured
    costs = CostModel()
    costs.draft, costs.verify, costs.prefill = {1: 0.2}, {1: 1.0, 8: 1.4}, {"target": 0.05, "draft": 0.02}
    engine.controller.costs = costs
    # K = 3 at 0.8: 2.95 tokens per (0.6 + 1.17) = 1.67 per pass-time, saving 0.4 pass-times per token
    assert auto.reading_pays(1, 100, 64)  # 100 prompt tokens: 2.0 to read, 25.6 saved
    auto.share = 0.05  # the trie, not the model, drafted 19 steps in 20 lately: 1.3 saved
    assert not auto.reading_pays(1, 100, 64)
    auto.share = 1.0
    assert not auto.reading_pays(1, 2000, 64)  # 40 to read
    costs.draft = {1: 0.8}  # drafting 3 tokens costs 2.4 pass-times: slower than plain, never read
    assert not auto.reading_pays(1, 10, 10_000)


@pytest.mark.parametrize("second", [None, "noisy copy"])
def test_seeded_sampling_is_reproducible(second):
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=30, ignore_eos=True, seed=7)
    outs = []
    for _ in range(2):
        engine = auto_engine(second, 4, True, share=True)
        outs.append([generate(engine, p, params).token_ids for p in PROMPTS + PROMPTS])
    assert outs[0] == outs[1]


def test_sampled_tokens_follow_the_target():
    """Temperature 1, the trie beside a draft model that agrees half the time: the first two emitted tokens over
    1200 seeds follow the target's distributions (test_sampling_distribution's tolerances)."""
    assert_first_two_follow_the_target(auto_engine("noisy copy", 3, True), seeds=1200, min_drafted=600,
                                       min_seconds=150)


# ------------------------------------------------------------------------------------------- with Medusa heads
@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    from test_heads_engine import heads_dir, target as heads_target

    return heads_target("fp32"), heads_dir("medusa", str(tmp_path_factory.mktemp("heads")))


def medusa_engine(medusa, batch: int = 1, share: bool = True, tree: bool = False,
                  auto=AutoHeadsProposer) -> Engine:
    model, folder = medusa
    heads = MedusaProposer(load_heads(folder, model, "medusa"), model.config.vocab_size, max_depth=3)
    proposer = auto(SuffixProposer(SuffixCache(DEPTH, 100, share_unsalted=share)), heads, 3, "medusa", tree=tree)
    engine = Engine(model, FakeTokenizer(), proposer, num_speculative_tokens=DEPTH, max_model_len=256,
                    max_batch_size=batch)
    engine.controller.costs = SpeculationPays()
    return engine


def test_auto_beside_medusa_equals_plain_and_uses_both(medusa):
    from test_heads_engine import plain as heads_plain

    engine = medusa_engine(medusa, batch=2)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS + PROMPTS)]
    finals = run(engine, requests, join_at=[0, 0, 3, 5, 9, 12])
    used = {}
    for rid, prompt, _ in requests:
        assert finals[rid].token_ids == heads_plain("fp32", prompt), rid
        for name, counts in finals[rid].metrics.drafters.items():
            used[name] = used.get(name, 0) + counts.accepted
    assert used.get("medusa", 0) > 0 and used.get("suffix", 0) > 0, used


class AsksTheHeadsEveryStep(AutoHeadsProposer):
    """The reference: the heads asked for every row at every step, their best case never weighed first."""

    def _asks(self, ks, rows, tries, values):
        return [min(k, self.k) for k in ks]


def test_the_heads_are_asked_only_where_they_could_beat_the_tries_draft(medusa):
    """`AutoHeadsProposer` asks the heads only for the rows where their best case could beat the trie's draft.
    Step by step, the drafts chosen (tokens and drafter) are those of asking the heads at every step
    (`AsksTheHeadsEveryStep`), and the outputs plain decoding's, with fewer rows asked of the heads."""
    from test_heads_engine import plain as heads_plain

    def recorded(auto):
        engine = medusa_engine(medusa, auto=auto)
        proposer = engine.proposer
        chosen, asked = [], []
        propose, draft = proposer.propose, proposer.second.draft

        def spy_propose(seqs, ks):
            proposal = propose(seqs, ks)
            chosen.append([(d.tokens, d.source) for d in proposal.drafts])
            return proposal

        def spy_draft(seqs, ks):
            asked.append(sum(1 for k in ks if k))
            return draft(seqs, ks)

        proposer.propose, proposer.second.draft = spy_propose, spy_draft
        outs = [generate(engine, prompt, GREEDY).token_ids for prompt in PROMPTS + PROMPTS]
        return outs, chosen, asked

    outs, chosen, asked = recorded(AutoHeadsProposer)
    every_outs, every_chosen, every_asked = recorded(AsksTheHeadsEveryStep)
    assert outs == every_outs == [heads_plain("fp32", prompt) for prompt in PROMPTS + PROMPTS]
    assert chosen == every_chosen
    assert {source for step in chosen for _, source in step} >= {"suffix", "medusa"}
    assert 0 < sum(asked) < sum(every_asked), (sum(asked), sum(every_asked))


def test_two_drafter_trees_equal_plain(medusa):
    """With `tree`, one sequence at a time: where the trie and the heads disagree, the pass carries both
    branches (drafter "suffix+medusa"); greedy output stays plain decoding's, and trees were verified."""
    from test_heads_engine import plain as heads_plain

    engine = medusa_engine(medusa, tree=True)
    trees = 0
    for prompt in PROMPTS + PROMPTS:
        out = generate(engine, prompt, GREEDY)
        assert out.token_ids == heads_plain("fp32", prompt)
        assert_metrics_consistent(out)
        trees += out.metrics.drafters.get("suffix+medusa", DrafterCounts()).drafts
    assert trees > 0


def test_two_drafter_trees_keep_the_sampled_distribution(medusa):
    """Temperature 1, trees of the trie's point masses beside the heads' distributions: the first two emitted
    tokens over 1200 seeds follow the target's distributions (test_sampling_distribution's tolerances), with
    hundreds of trees verified among them."""
    model, _ = medusa
    engine = medusa_engine(medusa, tree=True)
    prompt = list(PROMPTS[1])
    firsts, pairs, trees = [], [], 0
    for seed in range(1200):
        # 4 tokens, so that the first step may draft 3 (two branches); the first two are compared
        out = generate(engine, prompt, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=seed))
        firsts.append(out.token_ids[0])
        pairs.append(tuple(out.token_ids[:2]))
        trees += out.metrics.drafters.get("suffix+medusa", DrafterCounts()).drafts
    assert trees > 300  # (529 trees in a run here)

    def target_probs(tokens):
        cache = model.new_cache(1, 64)
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0, -1]
        return process_logits(logits[None].float(), SamplingParams(temperature=1.0))[0]

    assert_follows(torch.tensor(firsts), target_probs(prompt), "first token")
    top = max(set(firsts), key=firsts.count)
    seconds = [b for a, b in pairs if a == top]
    assert len(seconds) > 150
    assert_follows(torch.tensor(seconds), target_probs(prompt + [top]), "second token")


# ------------------------------------------------------------------------------------------- the defaults
def test_the_default_speculation_is_auto_and_flags_keep_their_meaning():
    spec = build_speculative_config(None, None, None)  # no flags
    assert (spec.method, spec.model, spec.with_suffix, spec.adaptive) == ("auto", None, True, True)
    assert build_speculative_config(None, 0, None) is None  # --num-speculative-tokens 0: plain decoding
    seed = build_speculative_config("d", 5, None)  # the seed's command: its draft model, K = 5, and the trie
    assert (seed.method, seed.num_speculative_tokens, seed.adaptive, seed.with_suffix) == ("draft_model", 5, False, True)
    assert seed.max_tokens == DEPTH
    alone = build_speculative_config("d", 5, '{"suffix": false}')
    assert not alone.with_suffix and alone.max_tokens == 5
    medusa_ = build_speculative_config(None, None, '{"method": "medusa", "model": "h"}')
    assert not medusa_.with_suffix  # heads named alone run alone
    assert build_speculative_config(None, None, '{"method": "medusa", "model": "h", "suffix": true}').with_suffix
    for bad, message in [({"method": "auto", "suffix": False}, "does not apply"),
                         ({"method": "auto", "tree": "default"}, "need chains"),
                         ({"method": "ngram", "suffix": True}, "does not apply"),
                         ({"method": "draft_model", "model": "d", "suffix": "yes"}, "true or false")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(bad)


def test_llm_defaults_to_auto_on_a_target_without_heads(tmp_path):
    """`LLM(model)` with no speculation arguments runs auto speculation, here the trie alone (no heads are
    shipped for this target), and says so; its greedy output is plain decoding's (`num_speculative_tokens=0`)."""
    from specdec import LLM
    from test_tokenizer import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    kw = dict(quantization="none", dtype="float32", max_model_len=128)
    auto, plain_llm = LLM(str(path), **kw), LLM(str(path), num_speculative_tokens=0, **kw)
    info = auto.describe()["speculative"]
    assert (info["method"], info["drafters"], info["suffix_decoding_share_unsalted"]) == ("auto", ["suffix"], False)
    assert type(auto.engine.proposer) is AutoProposer and isinstance(auto.engine.proposer.second, NullProposer)
    assert plain_llm.describe()["speculative"] is None
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in ("abab", "abcabcab"):
        assert auto.generate([prompt], greedy)[0].token_ids == plain_llm.generate([prompt], greedy)[0].token_ids
