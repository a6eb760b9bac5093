"""Bit-exact greedy equivalence on the real pair, in the default numerics: speculative == plain.

Also checks the property the design rests on: a row's logits do not depend on how many rows the target
computes together (1 for plain decoding, K + 1 for verification) or on the key length.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from specdec.bench.compare import decode as run
from specdec.config import SamplingParams
from specdec.data import DATA_DIR
from specdec.engine import Engine
from specdec.speculative.draft_model import DraftModelProposer
from specdec.speculative.proposers import NgramProposer

DATA = DATA_DIR  # the prompt sets shipped with specdec
pytestmark = pytest.mark.real


def prompts(tokenizer) -> list[list[int]]:
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line) for line in f]
    with open(DATA / "spec_bench" / "question.jsonl") as f:
        spec_bench = [json.loads(line) for line in f]
    # scored by the benchmarks too; exactness is not a score, so any prompts will do
    chats = [q for q in spec_bench if q["category"] == "translation"][:1]
    texts = [humaneval[2]["prompt"], humaneval[10]["prompt"]]
    ids = [tokenizer.encode(t) for t in texts]
    ids += [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}]))
            for q in chats]
    return ids


@pytest.fixture(scope="module")
def pair():
    from specdec import LLM

    llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_model="qwen2.5-coder-0.5b-instruct",
              num_speculative_tokens=5, max_model_len=1024)
    return llm


def test_target_rows_do_not_depend_on_rows_computed_together(pair):
    """Feeding the same 80 tokens in passes of 1, 2, 3, 6 or 9 rows gives every row the same logits, bit for
    bit, across several 64-key attention blocks (regression: a softmax row whose length was not a multiple of
    the vector width computed its tail with the scalar exp and flipped a greedy token)."""
    model = pair.target
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        ids = pair.tokenizer.encode(json.loads(next(f))["prompt"])[:100]
    start = len(ids) - 80
    logits = {}
    for width in (1, 2, 3, 6, 9):
        cache = model.new_cache(1, 128)
        model(torch.tensor([ids[:start]]), torch.arange(start)[None], cache)
        cache.advance(0, start)
        rows = []
        for s in range(start, len(ids), width):
            chunk = ids[s:s + width]
            rows.append(model(torch.tensor([chunk]), torch.arange(s, s + len(chunk))[None], cache)[0])
            cache.advance(0, len(chunk))
        logits[width] = torch.cat(rows)
    for width in (2, 3, 6, 9):
        assert torch.equal(logits[width], logits[1]), f"{width} rows at once round differently from 1"


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_draft_model_greedy_is_bit_exact(pair, k, plain_outputs):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for ids, expected in zip(prompts(pair.tokenizer), plain_outputs):
        engine = Engine(pair.target, pair.tokenizer, DraftModelProposer(pair.draft_model, 1, 1024),
                        num_speculative_tokens=k, max_model_len=1024)
        out = run(engine, ids, params)
        assert out.token_ids == expected
        assert out.metrics.num_drafts > 0


def test_ngram_and_adaptive_greedy_are_bit_exact(pair, plain_outputs):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for ids, expected in zip(prompts(pair.tokenizer), plain_outputs):
        ngram = Engine(pair.target, pair.tokenizer, NgramProposer(), num_speculative_tokens=5, max_model_len=1024)
        assert run(ngram, ids, params).token_ids == expected
        adaptive = Engine(pair.target, pair.tokenizer, DraftModelProposer(pair.draft_model, 1, 1024),
                          num_speculative_tokens=5, adaptive=True, max_model_len=1024)
        assert run(adaptive, ids, params).token_ids == expected


@pytest.fixture(scope="module")
def plain_outputs(pair):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = []
    for ids in prompts(pair.tokenizer):
        out = run(Engine(pair.target, pair.tokenizer, None, num_speculative_tokens=0, max_model_len=1024), ids, params)
        assert len(out.token_ids) == 64
        outs.append(out.token_ids)
    return outs


HEAD_CONFIGS = {  # name: (shipped heads qwen2.5-coder-1.5b-instruct-HEADS, K, tree, their matrices' format)
    "medusa chain K=3": ("medusa", 3, None, "auto"),
    "medusa tree": ("medusa", 3, "default", "auto"),
    "eagle chain K=4": ("eagle", 4, None, "auto"),
    "eagle dynamic tree": ("eagle", 4, "dynamic", "auto"),
    "eagle3 chain K=3": ("eagle3", 3, None, "auto"),
    "eagle3 chain K=3, q4_0": ("eagle3", 3, None, "q4_0"),
}
HEAD_PROMPTS = 2  # of the 3: each tree node is a target row, which costs time on this CPU


@pytest.mark.parametrize("name", list(HEAD_CONFIGS))
def test_shipped_heads_greedy_is_bit_exact(pair, plain_outputs, name):
    """The Medusa, EAGLE and EAGLE-3 heads shipped for the default target, chain and tree, their matrices in
    Q8_0 or Q4_0: speculative == plain."""
    from specdec.heads.files import load_heads, resolve_heads
    from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
    from specdec.speculative.tree import DynamicTree

    heads, k, tree, fmt = HEAD_CONFIGS[name]
    method = "eagle" if heads.startswith("eagle") else heads
    head = load_heads(resolve_heads(f"qwen2.5-coder-1.5b-instruct-{heads}"), pair.target, method, fmt)
    shape = {None: None, "default": default_tree(k), "dynamic": DynamicTree(top_k=2, beam=1)}[tree]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    accepted = 0
    for ids, expected in list(zip(prompts(pair.tokenizer), plain_outputs))[:HEAD_PROMPTS]:
        vocab = pair.target.config.vocab_size
        proposer = MedusaProposer(head, vocab, shape, max_depth=k) if method == "medusa" else \
            EagleProposer(head, vocab, 1, 1024, shape, max_depth=k)
        out = run(Engine(pair.target, pair.tokenizer, proposer, num_speculative_tokens=k,
                         max_model_len=1024), ids, params)
        assert out.token_ids == expected
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0


def test_shipped_medusa_heads_run_together_give_each_head_its_own_bits(pair):
    """On the target's blocks the heads' states go through the output layer as one multi-row call: each
    head's logits are the bits of running it alone (the kernels' row invariance)."""
    from specdec.heads.files import load_heads, resolve_heads

    head = load_heads(resolve_heads("qwen2.5-coder-1.5b-instruct-medusa"), pair.target, "medusa")
    hidden = torch.randn(pair.target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(pair.target.dtype)
    together = head(hidden)
    for i, block in enumerate(head.blocks):
        assert torch.equal(together[i], head.logits(block(hidden)))
    assert torch.equal(head(hidden, 2), together[:2])


def test_tree_nodes_get_the_bits_of_their_path_decoded_alone(pair):
    """A tree verified in one pass gives every node the logits that decoding its path one token at a time
    gives, bit for bit (regression: nodes attended through one batched matmul over all nodes took another
    kernel and differed in the last bits, which flipped a greedy token of a Medusa tree in the benchmark)."""
    import copy

    from specdec.speculative.tree import ancestor_mask, depths

    model = pair.target
    ids = prompts(pair.tokenizer)[0]
    parents = [-1, -1, 0, 0, 1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    for L in (len(ids) - 1, 2 * len(ids) - 3):
        prefix = (ids * 2)[:L]
        nodes = torch.randint(0, 150000, (len(parents),), generator=gen).tolist()
        cache = model.new_cache(1, 512)
        model(torch.tensor([prefix]), torch.arange(L)[None], cache)
        cache.advance(0, L)
        prefilled = copy.deepcopy(cache)
        positions = torch.tensor([[L] + [L + d for d in depths(parents)]])
        tree_logits = model(torch.tensor([[42] + nodes]), positions, cache, mask=ancestor_mask(parents)[None])[0]
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.insert(0, nodes[j])
                j = parents[j]
            alone = copy.deepcopy(prefilled)
            for d, token in enumerate([42] + path):
                logits = model(torch.tensor([[token]]), torch.tensor([[L + d]]), alone)[0, 0]
                alone.advance(0, 1)
            assert torch.equal(tree_logits[i + 1], logits), (L, i)


def test_a_second_chat_turn_from_the_prefix_cache_is_bit_exact(pair):
    """Two turns of a chat through `LLM.chat` (the draft model drafting): the second finds the first's prompt
    and the start of its answer (K/V computed by verification passes) in the prefix cache, and samples
    (seeded), bit for bit, what it samples after `reset_prefix_cache`, from a cold prefill of target and draft."""
    turn1 = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    first = pair.chat(turn1, SamplingParams(temperature=0, max_tokens=16))[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Add a docstring."}]
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=0)
    hit = pair.chat(turn2, params)[0]
    pair.reset_prefix_cache()
    cold = pair.chat(turn2, params)[0]
    assert cold.metrics.cached_tokens == 0 and hit.metrics.cached_tokens > len(first.prompt_token_ids)
    assert hit.token_ids == cold.token_ids and hit.metrics.num_drafts > 0


@pytest.mark.parametrize("way", ["ride", "own pass"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft model"])
def test_a_prompt_read_inside_another_sequences_passes_is_bit_exact(pair, plain_outputs, speculative, way):
    """Prompt 0 decodes while prompt 1 joins: prompt 1's tokens ride 7 at a time in prompt 0's passes (rows of
    unequal lengths on the block kernels; with the draft model, verification passes of K + 1 rows padded to
    the prompt's 7), or are read 7 at a time in passes of their own between prompt 0's (`prefill.ride_pays`
    chooses; pinned here). Both outputs equal plain decoding's of each alone."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = prompts(pair.tokenizer)[:2]
    proposer = DraftModelProposer(pair.draft_model, 2, 1024) if speculative else None
    engine = Engine(pair.target, pair.tokenizer, proposer, num_speculative_tokens=5 if speculative else 0,
                    max_model_len=1024, max_batch_size=2)
    engine.chunk_budget.tokens = lambda batch_size: 7
    engine.planner.ride_pays = lambda tokens: way == "ride"
    rode, read = [], engine.planner.rode
    engine.planner.rode = lambda riding: (rode.append(len(riding.rows.tokens)), read(riding))
    engine.add_request("0", ids[0], params)
    finals, added, own = {}, False, []
    while engine.has_unfinished_requests():
        if not added and engine.running and engine.running[0].num_output >= 2:
            engine.add_request("1", ids[1], params)
            added = True
        finals |= {out.request_id: out for out in engine.step() if out.finished}
        own += [engine.plan.fed.tokens] if engine.plan.fed.tokens else []
    if way == "ride":
        assert len(rode) >= 5 and max(rode) == 7  # it rode (and was not fed alone)
    else:  # read 7 at a time in passes of its own beside prompt 0's (the rest at once if prompt 0 ends first)
        assert rode == [] and len(own) >= 5 and max(own) == 7
    assert [finals["0"].token_ids, finals["1"].token_ids] == plain_outputs[:2]


def test_a_preempted_sequence_recomputes_its_tokens_bit_exactly(pair, plain_outputs):
    """Prompts 0 and 1 join together (the draft model drafting, K = 5) in a pool that holds both prompts but
    not both answers: the newer one is preempted, reads its prompt and output so far again on the block kernels
    (in chunks and riding rows, where it wrote them one verification pass at a time), and goes on. Both outputs
    equal plain decoding's of each alone."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = prompts(pair.tokenizer)[:2]
    length = len(ids[0]) + len(ids[1]) + 32  # the context, and the pool's slots for rows: 32 to write, not 128
    proposer = DraftModelProposer(pair.draft_model, 2, length)
    engine = Engine(pair.target, pair.tokenizer, proposer, num_speculative_tokens=5, max_model_len=length,
                    max_batch_size=2, row_tokens=length)
    for i in range(2):
        engine.add_request(str(i), ids[i], params)
    finals, together = {}, False
    while engine.has_unfinished_requests():
        finals |= {out.request_id: out for out in engine.step() if out.finished}
        together |= len(engine.running) == 2
    assert together and finals["1"].metrics.preemptions > 0 and finals["0"].metrics.preemptions == 0
    assert [finals["0"].token_ids, finals["1"].token_ids] == plain_outputs[:2]
