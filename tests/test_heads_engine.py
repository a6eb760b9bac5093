"""Medusa and EAGLE proposers in the engine, on a tiny random target with heads trained on it for a few
seconds: greedy output equals plain decoding exactly (chain and tree, several K, single and batched with
requests joining late), tree steps really keep nodes off the first branch, and seeded sampling is
reproducible and batch-independent."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, step_clock, varied_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.heads.files import load_heads
from specdec.training import TrainConfig, train_heads
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.costs import CostModel
from specdec.speculative.controller import ByKind
from specdec.speculative.tree import DynamicTree, TreeShape
from test_engine_tiny import PROMPTS, run
from test_heads import ByteTokenizer

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

MAX_LEN = 256
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TREES = {
    "chain": None,
    "default tree": "default",
    "wide tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0]],
    "dynamic tree": DynamicTree(top_k=2, beam=2),
}


@lru_cache(maxsize=None)
def target(dtype_name: str):
    """`varied_model` with its attention outputs scaled down: its greedy text still varies (~27 distinct ids
    in 40 tokens) but depends mostly on the last token, so heads trained for seconds agree with it ~25% of
    the time (on `varied_model` itself they stay near chance, which would make the tests vacuous)."""
    model = varied_model(seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
    return model.to(DTYPES[dtype_name]).eval()


@lru_cache(maxsize=None)
def heads_dir(method: str, tmp_root: str) -> str:
    from pathlib import Path

    out = Path(tmp_root) / method
    with torch.inference_mode(False):
        gen = torch.Generator().manual_seed(7)
        prompts = tuple(tuple(torch.randint(0, 96, (8,), generator=gen).tolist()) for _ in range(48))
        eagle3 = {"feature_layers": (0,), "ttt_steps": 3} if method == "eagle3" else {}  # EAGLE-3 style
        train_heads(target("fp32"), ByteTokenizer(), "tiny", TrainConfig(
            method=method.removesuffix("3"), out=out, **eagle3, corpus_tokens=0, self_distill_prompts=48, self_distill_tokens=56,
            prompts=prompts, seq_len=64, vocab_size=97, num_heads=3, epochs=8, batch_size=4, lr=3e-3,
            checkpoint_every=1000,
        ))
    return str(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("heads"))
    return lambda method: heads_dir(method, root)


def make_engine(trained, method: str, dtype_name: str, k: int, tree, max_batch_size: int = 1,
                max_len: int = MAX_LEN, adaptive: bool = False, clock=None) -> Engine:
    model = target(dtype_name)
    head = load_heads(trained(method), model, method.removesuffix("3"))
    if isinstance(tree, DynamicTree) or tree is None:
        shape = tree
    else:
        shape = default_tree(k) if tree == "default" else TreeShape.from_choices(tree)
    vocab = model.config.vocab_size
    if method == "medusa":
        proposer = MedusaProposer(head, vocab, shape, max_depth=k)
    else:
        proposer = EagleProposer(head, vocab, max_batch_size, max_len, shape, max_depth=k)
    return Engine(model, FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=max_len,
                  max_batch_size=max_batch_size, adaptive=adaptive, clock=clock)


def plain(dtype_name: str, prompt, params=GREEDY, max_len: int = MAX_LEN):
    engine = Engine(target(dtype_name), FakeTokenizer(), max_model_len=max_len)
    return run(engine, [("r", prompt, params)])["r"].token_ids


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("method,k", [("medusa", 1), ("medusa", 3), ("eagle", 1), ("eagle", 3), ("eagle", 5),
                                      ("eagle3", 1), ("eagle3", 3)])
def test_greedy_equals_plain_decoding(trained, method, k, tree, dtype_name):
    engine = make_engine(trained, method, dtype_name, k, TREES[tree])
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        out = run(engine, [(f"r{i}", prompt, GREEDY)])[f"r{i}"]
        assert out.token_ids == plain(dtype_name, prompt), (method, k, tree, i)
        accepted += out.metrics.num_accepted_tokens
        assert out.metrics.target_passes < len(out.token_ids) or out.metrics.num_accepted_tokens == 0
    assert accepted > 0  # the heads agree with the target sometimes: the comparison is not vacuous


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_steps_keep_nodes_off_the_first_branch(trained, method):
    """Exactness with trees must not rest on the first branch alone: count steps whose kept path leaves it."""
    engine = make_engine(trained, method, "fp32", 3, TREES["wide tree"])
    off_branch = 0
    observe = engine.proposer.observe
    ranks = TreeShape.from_choices(TREES["wide tree"]).ranks

    def spy(seqs, drafts, verdicts, hidden=None):  # the proposer is told each step's verdicts
        nonlocal off_branch
        for draft, verdict in zip(drafts, verdicts):
            if verdict.path and draft.parents is not None and any(ranks[i] for i in verdict.path):
                off_branch += 1
        observe(seqs, drafts, verdicts, hidden)

    engine.proposer.observe = spy
    for i, prompt in enumerate(PROMPTS):
        assert run(engine, [(f"r{i}", prompt, GREEDY)])[f"r{i}"].token_ids == plain("fp32", prompt)
    assert off_branch > 0


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_batched_requests_joining_late_equal_their_plain_output(trained, method):
    engine = make_engine(trained, method, "bf16", 3, "default", max_batch_size=3)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    finals = run(engine, requests, join_at=[0, 3, 7])
    for rid, prompt, _ in requests:
        assert finals[rid].token_ids == plain("bf16", prompt)


@pytest.mark.parametrize("tree", ["chain", "default tree"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_joining_prompts_pairs_take_no_pages_in_the_running_rows(trained, method, tree):
    """A prompt that joins running sequences leaves its pairs pending for the head's next feed: they are fed in
    its row alone, not with every running row padded to the prompt's width (pages that no row needs, which the
    scheduler never counted: an EAGLE tree's pool ran out so). After every step each running row of the head's
    cache holds at most the pages of its tokens and a draft, and both outputs equal plain decoding's."""
    engine = make_engine(trained, method, "fp32", 3, TREES[tree], max_batch_size=2, clock=step_clock())
    cache, widest = engine.proposer.cache, engine.widest
    long = tuple((PROMPTS[2] * 10)[:50])
    requests = [("short", PROMPTS[0], GREEDY), ("long", long, GREEDY)]
    over, beside = [], []

    def check(outputs):
        over.extend(len(cache.pages[s.row]) - cache.pages_for(len(s.tokens) + widest) for s in engine.running)
        ids = [s.request_id for s in engine.running]
        if "long" in ids and not beside:
            beside.append(ids)

    finals = run(engine, requests, join_at=[0, 2], on_step=check)
    assert beside == [["short", "long"]]  # it joined the short one, which was decoding
    assert max(over) <= 0
    for rid, prompt, _ in requests:
        assert finals[rid].token_ids == plain("fp32", prompt)


@pytest.mark.parametrize("tree", ["default", "dynamic tree"])
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_seeded_tree_sampling_is_reproducible_and_batch_independent(trained, method, tree):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    alone = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine = make_engine(trained, method, "fp32", 3, TREES.get(tree, tree))
        alone.append(run(engine, [(f"r{i}", prompt, p)])[f"r{i}"].token_ids)
    engine = make_engine(trained, method, "fp32", 3, TREES.get(tree, tree), max_batch_size=3)
    finals = run(engine, [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(PROMPTS, params))],
                 join_at=[0, 2, 5])
    assert [finals[f"r{i}"].token_ids for i in range(3)] == alone
    assert len({tuple(a) for a in alone}) == 3


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_trees_run_to_the_very_end_of_the_context(trained, method):
    """A wide tree near the end of the context (more nodes than tokens left), beside a long prompt that
    joins late: no overflow, output exact, and it stops at the context length."""
    max_len = 70
    engine = make_engine(trained, method, "bf16", 3, TREES["wide tree"], max_batch_size=2, max_len=max_len)
    long_prompt = tuple(range(5, 65))
    short = SamplingParams(temperature=0, max_tokens=max_len - len(PROMPTS[0]), ignore_eos=True)
    late = SamplingParams(temperature=0, max_tokens=max_len - len(long_prompt), ignore_eos=True)
    finals = run(engine, [("a", PROMPTS[0], short), ("b", long_prompt, late)], join_at=[0, 50])
    assert finals["a"].token_ids == plain("bf16", PROMPTS[0], short, max_len)
    assert finals["b"].token_ids == plain("bf16", long_prompt, late, max_len)
    assert len(PROMPTS[0]) + len(finals["a"].token_ids) == max_len


PROCESSED = {
    "penalties and bias": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                                         frequency_penalty=1.2, presence_penalty=0.8, logit_bias={5: 3.0, 17: 2.0}),
    "stop tokens, min_tokens, logprobs": SamplingParams(temperature=0, max_tokens=40, min_tokens=6,
                                                        stop_token_ids=[47, 74, 91], logprobs=2),
}


@pytest.mark.parametrize("name", list(PROCESSED))
@pytest.mark.parametrize("tree", ["chain", "wide tree", "dynamic tree"])
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_processed_logits_over_tree_drafts_equal_plain(trained, method, tree, name):
    """Each tree node is judged with the history on its own path (penalties, min_tokens); the logprobs of
    the emitted tokens are those of the rows that judged them."""
    params = PROCESSED[name]
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        engine = make_engine(trained, method, "fp32", 3, TREES[tree])
        out = run(engine, [(f"r{i}", prompt, params)])[f"r{i}"]
        ref = run(Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN), [("r", prompt, params)])["r"]
        assert out.token_ids == ref.token_ids, (method, tree, i)
        if params.logprobs is not None:
            assert [(e.token_id, e.rank) for e in out.logprobs] == [(e.token_id, e.rank) for e in ref.logprobs]
            assert [e.logprob for e in out.logprobs] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0
    assert any(plain("fp32", prompt, params) != plain("fp32", prompt) for prompt in PROMPTS), \
        "the parameters change the output"


class FixedHeads:
    """Medusa heads whose reduced logits are fixed: rows of log-probabilities, one per head."""

    def __init__(self, probs: list[list[float]]) -> None:
        self.logits = torch.tensor(probs).log()
        self.config = type("Config", (), {"num_heads": len(probs)})()
        self.vocab_ids = torch.arange(self.logits.shape[1])

    def __call__(self, state: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        return self.logits[:num_heads].expand(*state.shape[:-1], -1, -1)

    def expand(self, reduced: torch.Tensor, vocab: int) -> torch.Tensor:
        return reduced.new_full((*reduced.shape[:-1], vocab), float("-inf")).index_copy_(-1, self.vocab_ids, reduced)


@dataclass
class HeadSeq:
    draft_state: torch.Tensor = field(default_factory=lambda: torch.zeros(4))
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))


def test_a_head_chain_labels_each_token_by_its_depth_and_how_sure_the_head_is():
    heads = FixedHeads([[0.95, 0.05, 0.0, 0.0], [0.1, 0.6, 0.3, 0.0], [0.35, 0.3, 0.2, 0.15]])
    chain = MedusaProposer(heads, 8, None, max_depth=3)
    assert chain.guess_kinds == 3 * 6
    draft = chain.draft([HeadSeq()], [3])[0]
    # 0.95 at depth 0: above 0.9 (sureness 5); 0.6 at depth 1: in [0.5, 0.75) (3); 0.35 at depth 2: in [0.25, 0.5) (2)
    assert draft.tokens == [0, 1, 0] and draft.kinds == [0 * 6 + 5, 1 * 6 + 3, 2 * 6 + 2]
    assert chain.draft([HeadSeq()], [2])[0].kinds == [5, 9]
    tree = MedusaProposer(heads, 8, default_tree(3), max_depth=3)
    assert tree.guess_kinds == 0 and tree.draft([HeadSeq()], [3])[0].kinds is None


class MemoryBoundPasses(CostModel):
    """Pass costs as on a memory-bound target (each row 5% of a pass), not as measured: the cuts then follow
    the kinds' learned rates alone, whatever else loads the machine."""

    def pass_time(self, rows: int) -> float:
        return 1.0 + 0.05 * rows


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_adaptive_head_chains_are_cut_by_kind_of_guess_and_stay_exact(trained, method):
    """Adaptive heads: the controller learns each kind's acceptance from the labelled chains and cuts each
    step's draft to the width that pays (`ByKind`); the output is still plain decoding's, token for token."""
    engine = make_engine(trained, method, "fp32", 3, None, adaptive=True)
    assert isinstance(engine.controller.policy, ByKind)
    engine.controller.costs = MemoryBoundPasses()  # (the tiny model's measured passes jitter with the load)
    proposed, verified = [], []
    propose, cut = engine.proposer.propose, engine.controller.cut

    def spy_propose(seqs, ks):
        proposal = propose(seqs, ks)
        proposed.extend(proposal.drafts)
        return proposal

    def spy_cut(drafts, estimates):
        out = cut(drafts, estimates)
        verified.extend(out)
        return out

    engine.proposer.propose, engine.controller.cut = spy_propose, spy_cut
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        out = run(engine, [(f"r{i}", prompt, GREEDY)])[f"r{i}"]
        assert out.token_ids == plain("fp32", prompt), (method, i)
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0
    labelled = [d for d in proposed if d.tokens]
    assert labelled and all(d.kinds is not None and [k // 6 for k in d.kinds] == list(range(len(d.tokens)))
                            for d in labelled)
    for d, v in zip(proposed, verified):  # what is verified is a prefix of what was drafted, kinds and all
        assert v.tokens == d.tokens[:len(v.tokens)] and (not v.tokens or v.kinds == d.kinds[:len(v.tokens)])
    assert sum(engine.controller.policy.rates.tried) > 0  # the kinds' rates were learned from the verdicts
