"""Suffix decoding: the C++ trie against its Python reference (random sequences, removals, chains and trees),
a worked example, the cache (eviction of the oldest outputs, salts), and the engine on tiny random models:
greedy output equal to plain decoding's (chains and trees, fixed and adaptive K, batches joining and leaving),
a second request drafting from the first one's output, salt isolation, seeded sampling reproducible and
following the target's distribution."""

from __future__ import annotations

import random

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.api import build_speculative_config
from specdec.engine import Engine
from specdec.sampling import process_logits
from specdec.speculative.proposers import SuffixProposer
from specdec.speculative.suffix import PySuffixTrie, SuffixCache, SuffixDraft, SuffixTrie, load_library
from test_engine_tiny import GREEDY, MAX_LEN, PROMPTS, SpeculationPays, generate, plain, run, target
from test_sampling_distribution import assert_follows

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)


@pytest.fixture(scope="module")
def lib():
    lib = load_library()
    assert lib is not None, "the C++ trie did not build"
    return lib


# ------------------------------------------------------------------------------------------- the trie
def test_worked_example(lib):
    """[1 2 3 1 2 4 1 2 3], depth 8, context ending [1 2]: [1 2] was followed by 3 twice and 4 once, so the
    draft begins 3 (2/3), then [1 2 3]'s only continuation 1 (still 2/3), then 2, ..."""
    for trie in (SuffixTrie(8, lib), PySuffixTrie(8)):
        trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
        assert (trie.count([1, 2]), trie.count([1, 2, 3]), trie.count([2, 4, 1]), trie.count([5])) == (3, 2, 1, 0)
        draft = trie.speculate([7, 1, 2], max_tokens=4, min_token_prob=0.1)
        # match [1 2] (m = 2): 2 tokens at most (factor 1); match [2] alone: 1 token; the longer scores more
        assert draft == SuffixDraft([3, 1], [-1, 0], [2 / 3, 2 / 3], 4 / 3, 2)
        assert trie.speculate([7, 1, 2], 4, max_spec_factor=2.0).tokens == [3, 1, 2, 4]
        assert trie.speculate([7, 1, 2], 4, max_spec_factor=2.0, min_token_prob=0.7) == SuffixDraft()
        trie.remove(0)
        assert trie.count([1]) == 0 and trie.num_nodes == 1 and trie.speculate([1, 2], 4) == SuffixDraft()


def test_the_depth_bounds_match_and_draft(lib):
    """Depth 4: strings of 4 tokens at most, so a match of m tokens drafts 4 - m at most."""
    for trie in (SuffixTrie(4, lib), PySuffixTrie(4)):
        trie.extend(0, list(range(10)))
        assert trie.count([0, 1, 2, 3]) == 1 and trie.count([0, 1, 2, 3, 4]) == 0
        assert trie.speculate([0, 1], 8, max_spec_factor=4.0).tokens == [2, 3, 4]  # m = 1 ([1]): 3 > 2 tokens
        assert trie.speculate([0, 1], 8, max_spec_factor=4.0).match_len == 1
        # a tree: best-first by path probability; [1 2]'s likelier branch (3) ends at the depth, then 4's
        trie.remove(0)
        trie.extend(1, [1, 2, 3, 1, 2, 4, 1, 2, 3])
        tree = trie.speculate([7, 1, 2], 4, max_spec_factor=2.0, tree=True)
        assert (tree.tokens, tree.parents, tree.match_len) == ([3, 1, 4, 1], [-1, 0, -1, 2], 2)
        assert tree.probs == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


@pytest.mark.parametrize("seed", range(4))
def test_the_cpp_trie_equals_the_reference(lib, seed):
    """Random sequences over small vocabularies (many repeats), extended in pieces and removed in any order:
    after each operation both tries have the same nodes and counts and speculate the same drafts, chains and
    trees, for any limits."""
    rng = random.Random(seed)
    for _ in range(25):
        depth, vocab = rng.choice([2, 3, 5, 8, 24]), rng.choice([3, 5, 20])
        fast, ref, alive = SuffixTrie(depth, lib), PySuffixTrie(depth), []
        for _ in range(rng.randint(1, 10)):
            if rng.random() < 0.65 or not alive:
                seq_id = rng.randint(0, 5)
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
                fast.extend(seq_id, tokens)
                ref.extend(seq_id, tokens)
                alive.append(seq_id) if seq_id not in alive else None
            else:
                seq_id = alive.pop(rng.randrange(len(alive)))
                fast.remove(seq_id)
                ref.remove(seq_id)
            assert fast.num_nodes == ref.num_nodes
            for _ in range(4):
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
                assert fast.count(context[:depth]) == ref.count(context[:depth])
                for tree in (False, True):
                    args = (context, rng.randint(0, 12), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4]), tree)
                    assert fast.speculate(*args) == ref.speculate(*args), args


# ------------------------------------------------------------------------------------------- the cache
def test_the_cache_evicts_the_oldest_outputs():
    cache = SuffixCache(max_depth=8, max_cached_requests=2, share_unsalted=True)
    for i, key in enumerate("abc"):
        cache.start(key, [90, 91])
        cache.extend(key, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4])
        cache.stop(key)
    cache.start("d", [50])  # evicts "b" (only two outputs are kept: "c" and "d")
    assert len(cache.cached) == 2
    assert cache.speculate("d", [1, 2], 4).tokens == []  # "a": evicted before
    assert cache.speculate("d", [11, 12], 4).tokens == []  # "b": evicted now
    assert cache.speculate("d", [21, 22], 4).tokens == [23, 24]
    none = SuffixCache(max_depth=8, max_cached_requests=0)  # the request's own trie only
    none.start("a", [1, 2, 3])
    none.extend("a", [4, 1, 2])
    assert none.speculate("a", [1, 2], 4).tokens == [3, 4] and not none.global_tries
    none.stop("a")
    none.start("b", [7])
    assert none.speculate("b", [1, 2], 4).tokens == []


def test_salts_keep_outputs_apart():
    cache = SuffixCache(max_depth=8, max_cached_requests=10)
    cache.start("a", [1], salt="tenant-1")
    cache.extend("a", [5, 6, 7, 8])
    cache.stop("a")
    for key, salt, expected in [("b", "tenant-1", [7, 8]), ("c", "tenant-2", []), ("d", None, [])]:
        cache.start(key, [2], salt=salt)
        assert cache.speculate(key, [5, 6], 4).tokens == expected, salt
        cache.stop(key)


def test_unsalted_requests_share_nothing_unless_the_operator_says_so():
    """Tenancy: without a salt a request drafts from its own prompt and output only (how fast a guess is
    accepted would tell a client what another's output held); `share_unsalted` (a single-user server) shares."""
    for share, expected in ((False, []), (True, [7, 8])):
        cache = SuffixCache(max_depth=8, max_cached_requests=10, share_unsalted=share)
        cache.start("a", [1])
        cache.extend("a", [5, 6, 7, 8])
        cache.stop("a")
        cache.start("b", [2])
        assert cache.speculate("b", [5, 6], 4).tokens == expected, share
        assert len(cache.cached) == (2 if share else 0)  # unshared outputs are not even kept
        salted = SuffixCache(max_depth=8, max_cached_requests=10, share_unsalted=share)
        salted.start("a", [1], salt="s")
        salted.extend("a", [5, 6, 7, 8])
        salted.stop("a")
        salted.start("b", [2])  # unsalted: never another salt's outputs, shared or not
        assert salted.speculate("b", [5, 6], 4).tokens == []


def test_config_keys_and_defaults_are_vllms():
    spec = build_speculative_config(None, None, '{"method": "suffix"}')
    assert (spec.num_speculative_tokens, spec.adaptive) == (24, True)  # K: the depth, a maximum
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    spec = build_speculative_config(None, None, '{"method": "suffix", "suffix_decoding_max_tree_depth": 40, '
                                                '"num_speculative_tokens": 32, "tree": "dynamic"}')
    assert (spec.num_speculative_tokens, spec.adaptive, spec.tree) == (32, False, "dynamic")
    for bad in ({"tree": "default"}, {"suffix_decoding_max_tree_depth": 0},
                {"suffix_decoding_max_cached_requests": -1}, {"suffix_decoding_min_token_prob": 1.5}):
        with pytest.raises(ValueError):
            SpeculativeConfig(method="suffix", **bad)


# ------------------------------------------------------------------------------------------- the engine
def suffix_engine(k: int, adaptive: bool = False, tree: bool = False, batch: int = 1, cached: int = 100,
                  depth: int = 24, share_unsalted: bool = True) -> Engine:
    """(Unsalted requests share the global trie here, as on a single-user server, unless `share_unsalted` is
    False: the default of a served model.)"""
    proposer = SuffixProposer(SuffixCache(depth, cached, share_unsalted), tree=tree)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, adaptive=adaptive,
                    max_model_len=MAX_LEN, max_batch_size=batch)
    if adaptive:
        engine.controller.costs = SpeculationPays()  # the controller's choices do not depend on this machine's speed
    return engine


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("k,adaptive", [(1, False), (4, False), (24, False), (24, True)])
def test_greedy_suffix_equals_plain(k, adaptive, tree):
    engine = suffix_engine(k, adaptive, tree)  # one engine: later prompts draft from earlier outputs too
    accepted = 0
    for prompt in PROMPTS:
        out = generate(engine, prompt, GREEDY)
        assert tuple(out.token_ids) == plain("fp32", prompt)
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0


def test_a_batch_joining_and_leaving(lib):
    """Five requests through three rows, joining at different steps, with different lengths: each output is
    its plain one, and every request's trie is dropped when it leaves (its output kept in the global trie)."""
    engine = suffix_engine(6, batch=3)
    prompts = [PROMPTS[i % 3] for i in range(5)]
    lengths = [40, 12, 25, 40, 7]
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
    outs = run(engine, requests, join_at=[0, 0, 1, 3, 5])
    for (rid, prompt, params), n in zip(requests, lengths):
        assert tuple(outs[rid].token_ids) == plain("fp32", prompt)[:n]
    cache = engine.proposer.suffix_cache
    assert not cache.active and len(cache.cached) == 5
    assert sum(o.metrics.num_accepted_tokens for o in outs.values()) > 0


def test_the_global_trie_helps_a_second_request():
    """The same prompt twice: the second request drafts the first one's output and accepts far more; with the
    request's own trie only (max_cached_requests 0) it does not."""
    prompt = PROMPTS[0]  # its output varies: its own trie has less to offer
    for cached, gains in ((100, True), (0, False)):
        engine = suffix_engine(8, cached=cached)
        first, second = generate(engine, prompt, GREEDY), generate(engine, prompt, GREEDY)
        assert first.token_ids == second.token_ids == list(plain("fp32", prompt))
        more = second.metrics.num_accepted_tokens - first.metrics.num_accepted_tokens
        assert (more >= 20) == gains, (first.metrics.to_dict(), second.metrics.to_dict())
        if gains:
            assert second.metrics.target_passes <= len(second.token_ids) // 4


@pytest.mark.parametrize("share_unsalted", [False, True], ids=["default", "shared"])
def test_salt_isolation_in_the_engine(share_unsalted):
    """A request of another salt (or without one) drafts nothing from an earlier request's output; by default
    neither does an unsalted request from an unsalted one's (tenancy), unless unsalted requests share."""
    prompt = PROMPTS[0]
    engine = suffix_engine(8, share_unsalted=share_unsalted)
    outs = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", None), ("d", "tenant-1")):
        engine.add_request(rid, list(prompt), GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[rid] = out
        assert outs[rid].token_ids == list(plain("fp32", prompt))
    accepted = {rid: out.metrics.num_accepted_tokens for rid, out in outs.items()}
    assert accepted["a"] == accepted["b"] == accepted["c"] and accepted["d"] >= accepted["a"] + 10, accepted
    engine.add_request("e", list(prompt), GREEDY)  # after "c", unsalted too
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs["e"] = out
    assert outs["e"].token_ids == list(plain("fp32", prompt))
    gain = outs["e"].metrics.num_accepted_tokens - accepted["c"]
    assert (gain >= 10) == share_unsalted, (accepted, outs["e"].metrics.num_accepted_tokens)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_seeded_sampling_is_reproducible(tree):
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=30, ignore_eos=True, seed=7)
    outs = []
    for _ in range(2):
        engine = suffix_engine(8, tree=tree)
        outs.append([generate(engine, p, params).token_ids for p in PROMPTS + PROMPTS])
    assert outs[0] == outs[1]


def test_sampled_tokens_follow_the_target():
    """Temperature 1 on a low-entropy prompt the tries draft from: the first two emitted tokens, over 1500
    seeds, follow the target's distributions (the second given the most frequent first; the tolerances of
    test_sampling_distribution: 5 sigma + 3 draws per token, so a false failure has odds below 1e-4)."""
    assert_first_two_follow_the_target(suffix_engine(4), seeds=1500, min_drafted=1000, min_seconds=200)


def assert_first_two_follow_the_target(engine: Engine, seeds: int, min_drafted: int, min_seconds: int) -> None:
    """`engine` (on `target("fp32")`) samples the first two tokens after PROMPTS[1] (50 60 50 60 ...: the tries
    draft 60, 50, ...) at temperature 1 with `seeds` seeds: at least `min_drafted` tokens were drafted, and
    the first token and the second (given the most frequent first, drawn at least `min_seconds` times) follow
    the target's distributions."""
    model = target("fp32")
    prompt = list(PROMPTS[1])

    def target_probs(tokens):
        cache = model.new_cache(1, 64)
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0, -1]
        return process_logits(logits[None].float(), SamplingParams(temperature=1.0))[0]

    firsts, pairs, drafted = [], [], 0
    for seed in range(seeds):
        out = generate(engine, prompt, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=seed))
        firsts.append(out.token_ids[0])
        pairs.append(tuple(out.token_ids))
        drafted += out.metrics.num_draft_tokens
    assert drafted > min_drafted
    assert_follows(torch.tensor(firsts), target_probs(prompt), "first token")
    top = max(set(firsts), key=firsts.count)
    seconds = [b for a, b in pairs if a == top]
    assert len(seconds) > min_seconds
    assert_follows(torch.tensor(seconds), target_probs(prompt + [top]), "second token")


def test_a_prompt_trie_grows_chunk_by_chunk_as_the_target_reads_it():
    """The trie of a long prompt is built while the target reads it, chunk by chunk, not at the first step
    (where a 30k-token prompt's took seconds): after each prefill step it holds the prompt so far; the
    drafts and output are those of a trie built from the whole prompt at once."""
    prompt = tuple(PROMPTS[0]) * 3
    proposer = SuffixProposer(SuffixCache(24, 100, False))
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=8, adaptive=False,
                    max_model_len=MAX_LEN, prefill_chunk=8)
    engine.add_request("r", list(prompt), GREEDY)
    read = []
    while "r" not in proposer.suffix_cache.active or proposer.suffix_cache.consumed("r") < len(prompt):
        engine.step()
        read.append(proposer.suffix_cache.consumed("r"))
    assert read == list(range(8, len(prompt), 8)) + [len(prompt)], read
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    whole = suffix_engine(8)  # a prompt read in one chunk
    expected = generate(whole, prompt, GREEDY)
    assert tuple(outs["r"].token_ids) == tuple(expected.token_ids) == plain("fp32", prompt)
    assert outs["r"].metrics.num_accepted_tokens == expected.metrics.num_accepted_tokens > 0
