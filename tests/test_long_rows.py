"""Paged K/V rows (issue 31): every cache's rows take pages of one pool as their sequences grow, so a long
sequence runs beside short ones while their lengths fit the pool, and waits, with the requests behind it,
while they do not. Greedy outputs stay exactly the unbatched plain ones (every proposer kind with a cache of
its own or none, with and without prefix-cache hits); the memory plan serves the model's whole context by
default without taking the prefix cache or the batch of short requests, and lowers it only when one
sequence does not fit."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, step_clock
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.engine.memory import GiB, MemoryBudgetError, plan_memory
from specdec.models.kv_cache import PAGE, KVCache, KVCacheFull
from test_engine_tiny import MAX_LEN, make_proposer, run, target
from test_prefix_cache import KINDS, assert_pages_accounted, make_engine

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

LONG = tuple((13 * i + 7) % 90 for i in range(170))  # 170 + 40 tokens: longer than a short row of 64
REQUESTS = [  # (id, prompt, max_tokens, step at which it joins)
    ("a", (1, 2, 3, 4, 1, 2, 3, 4, 1, 2), 25, 0),
    ("b", (50, 60, 50), 9, 0),
    ("long", LONG, 40, 1),
    ("c", (7, 3, 88, 41, 9, 12, 30, 31, 32, 7, 3, 88), 30, 2),  # waits behind the long one
    ("again", LONG, 40, 3),  # the long prompt again: a prefix-cache hit where there is a cache
    ("d", (20, 21, 22, 20, 21), 17, 3),
]


def unbatched(prompt, max_tokens: int) -> tuple[int, ...]:
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN)
    out = run(engine, [("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))])["r"]
    return tuple(out.token_ids)


def test_reshape_keeps_the_rows_that_remain():
    cache = KVCache(target("fp32").config, 4, 64, torch.float32)
    cache.reserve(0, 30)
    for k in cache.keys:
        k.normal_()
    cache.lengths = [30, 0, 0, 0]
    before = [cache.gather(k, 1, 30).clone() for k in cache.keys]
    cache.reshape(1, 200)
    assert (cache.batch_size, cache.capacity, cache.lengths, cache.num_pages) == (1, 256, [30], 16)  # blocks of 64
    assert all(torch.equal(cache.gather(k, 1, 30), b) for k, b in zip(cache.keys, before))
    cache.reshape(4, 64, num_pages=5)
    assert (cache.batch_size, cache.capacity, cache.lengths, cache.num_pages) == (4, 64, [30, 0, 0, 0], 5)
    assert all(torch.equal(cache.gather(k, 1, 30), b) for k, b in zip(cache.keys, before))
    assert len(cache.free) == 3  # row 0's 2 pages kept
    cache.lengths = [30, 5, 0, 0]
    with pytest.raises(ValueError, match="cannot reshape"):
        cache.reshape(1, 256)  # row 1 holds tokens
    cache.lengths = [30, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot reshape"):
        cache.reshape(4, 64, num_pages=1)  # row 0 holds 2 pages


def test_rows_take_pages_as_they_grow_and_give_them_back():
    """Rows share one pool: a row takes the pages of the slots a pass writes, keeps them through rollback,
    gives them to the row it moves to, and back to the pool when cleared; a pass past the pool is refused
    before anything is written."""
    model = target("fp32")
    cache = model.new_cache(3, 128, num_pages=8)  # 3 rows of up to 128 slots, 128 slots in all
    assert (cache.num_pages, len(cache.free)) == (8, 8)
    model(torch.tensor([list(range(1, 41))]), torch.arange(40)[None], cache.row_view(1))  # row 1: 40 slots
    assert (len(cache.pages[1]), len(cache.free)) == (3, 5)
    cache.advance(1, 40)
    cache.truncate(1, 10)  # rollback keeps the pages
    assert len(cache.pages[1]) == 3
    pages = list(cache.pages[1])
    cache.move_row(1, 0)
    assert (cache.pages[0], cache.pages[1], cache.lengths[:2]) == (pages, [], [10, 0])
    with pytest.raises(KVCacheFull, match="5 free pages"):
        cache.reserve(2, 128)  # 8 pages: more than are free
    assert cache.pages[2] == [] and len(cache.free) == 5  # nothing taken
    cache.clear(0)
    assert len(cache.free) == 8
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        cache.reserve(2, 129)


@pytest.mark.parametrize("prefix_blocks", [0, 64], ids=["no prefix cache", "prefix cache"])
@pytest.mark.parametrize("kind,k", [("plain", 0), ("ngram", 3), ("noisy copy", 4)])
def test_a_long_sequence_among_short_ones_keeps_every_output_exact(kind, k, prefix_blocks):
    """4 rows share a pool of 256 slots (+ the drafts' pads): the long request (210 slots) joins beside the
    short ones while their lengths fit, waits while they do not, the short ones behind it wait for it, and
    every output is the unbatched one. With the prefix cache, the long prompt sent again maps the first one's
    pages, which count once, and runs beside it."""
    proposer = None if kind == "plain" else make_proposer("fp32", kind, max_batch_size=4)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=MAX_LEN,
                    max_batch_size=4, row_tokens=MAX_LEN, prefix_cache_blocks=prefix_blocks, prefix_block_size=PAGE,
                    prefill_chunk=48, clock=step_clock())
    assert engine.cache.batch_size == 4 and engine.cache.capacity >= MAX_LEN
    pool = engine.cache.num_pages
    batches = []

    def on_step(_outputs):
        ids = [s.request_id for s in engine.running] + ([engine.prefilling.request_id] if engine.prefilling else [])
        batches.append(ids)
        assert_pages_accounted(engine)  # no page lost, or shared but by the prefix cache's mapped blocks
        own = {page for row in engine.cache.pages for page in row}  # the rows' pages the prefix cache does not hold
        own -= engine.prefix_cache.held_pages.get("target", set()) if engine.prefix_cache else set()
        assert len(own) <= engine.cache.row_pages

    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in REQUESTS], on_step=on_step)
    for rid, prompt, n, _ in REQUESTS:
        assert tuple(finals[rid].token_ids) == unbatched(prompt, n), f"request {rid}"
    assert any("long" in ids and len(ids) > 1 for ids in batches)  # beside short ones
    # two long ones do not fit together, but with the prefix cache the second maps the first's prompt pages,
    # which count once (as the prefix cache's), and runs beside it
    assert any("long" in ids and "again" in ids for ids in batches) == (prefix_blocks > 0)
    assert len(engine.cache.free) + assert_pages_accounted(engine)["target"] == pool  # every page back (or cached)
    assert finals["again"].metrics.cached_tokens == (len(LONG) - 1) * (prefix_blocks > 0)  # blocks and a tail


@pytest.mark.parametrize("prefix_blocks", [0, 12], ids=["no prefix cache", "prefix cache"])
def test_requests_sharing_a_long_prompt_hold_it_once(prefix_blocks):
    """A pool of 256 slots (16 pages + a page a row), 4 rows, and 4 requests of one 150-token prompt with 20
    tokens each to write: each may come to hold 11 pages, so without a prefix cache two do not fit together
    (22 > 20) and they run one at a time. With a prefix cache of 12 blocks (12 more pages, which rows may take
    by evicting blocks no row holds: 32 in all, where 4 x 11 would not fit), each maps the 9 whole pages the
    first one's prompt wrote, which count once: all four run together (2 + 2 + 2 + 11, and the 9 shared), with
    the outputs of one alone."""
    prompt = tuple((11 * i + 3) % 90 for i in range(150))
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=4, row_tokens=MAX_LEN,
                    prefix_cache_blocks=prefix_blocks, prefix_block_size=PAGE, prefill_chunk=64, clock=step_clock())
    assert engine.cache.row_pages == 20 + prefix_blocks
    widest = []

    def on_step(_outputs):
        widest.append(len(engine.running))
        assert_pages_accounted(engine)

    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    finals = run(engine, [(str(i), prompt, p) for i in range(4)], on_step=on_step)
    assert max(widest) == (4 if prefix_blocks else 1)
    assert all(tuple(out.token_ids) == unbatched(prompt, 20) for out in finals.values())
    assert [finals[str(i)].metrics.cached_tokens for i in range(4)] == [0] + [149 * (prefix_blocks > 0)] * 3


def test_rows_take_the_prefix_cache_pages_no_row_holds():
    """A pool of 20 pages for rows and 12 for the prefix cache: requests of distinct 150-token prompts (10 pages
    each, 11 when done) join by what they hold, 3 at a time (30 <= 32: the second and third take pages of the
    blocks the first ones left, evicting them, least recently used first), with the outputs of one alone, and
    every page is accounted for."""
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=4, row_tokens=MAX_LEN,
                    prefix_cache_blocks=12, prefix_block_size=PAGE, prefill_chunk=64, clock=step_clock())
    prompts = [tuple((7 * i + 5 * j + 1) % 90 for i in range(150)) for j in range(4)]
    widest = []

    def on_step(_outputs):
        widest.append(len(engine.running))
        assert_pages_accounted(engine)

    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    finals = run(engine, [(str(j), prompt, p) for j, prompt in enumerate(prompts)], on_step=on_step)
    assert max(widest) == 3
    assert all(tuple(finals[str(j)].token_ids) == unbatched(prompt, 20) for j, prompt in enumerate(prompts))
    assert len(engine.prefix_cache.blocks) <= 12


@pytest.mark.parametrize("kind,k", [("plain", 0), ("noisy copy", 4)])
def test_pages_hold_finite_values_whatever_memory_the_pool_was_given(kind, k, monkeypatch):
    """Pools are allocated unwritten, a page zeroed when first handed out: with every new pool filled with NaN
    (memory that held anything), the requests of rows of different lengths, whose passes read masked slots of
    pages and page 0, give the unbatched outputs."""
    empty = torch.empty
    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        patched.setattr(torch.Tensor, "new_empty", lambda t, *a, **kw: torch.Tensor.new_zeros(t, *a, **kw).fill_(float("nan")))
        proposer = None if kind == "plain" else make_proposer("fp32", kind, max_batch_size=4)
        engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=MAX_LEN,
                        max_batch_size=4, row_tokens=MAX_LEN, prefix_cache_blocks=16, prefix_block_size=PAGE,
                        prefill_chunk=48)
    assert all(torch.isnan(kv[1:]).all() for kv in engine.cache.keys + engine.cache.values)
    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in REQUESTS])
    for rid, prompt, n, _ in REQUESTS:
        assert tuple(finals[rid].token_ids) == unbatched(prompt, n), f"request {rid}"


def test_a_request_longer_than_the_context_is_refused():
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=4, row_tokens=MAX_LEN)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        engine.add_request("r", list(LONG), SamplingParams(temperature=0, max_tokens=100))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=4, row_tokens=MAX_LEN - 1)


KV = 28 * 1024  # B/token: the default target (28 layers, 2 K/V heads of 128, bf16)


def test_the_models_context_keeps_the_short_requests_batch_and_prefix_cache():
    """The CPU default (weights + 4 GiB): 32768-token context, 8 rows of 4096 (or 1 of 32768), and the
    same prefix cache as rows of 4096 had."""
    plan = plan_memory(budget=20 * GiB, cache_space=4 * GiB, target_weights=GiB, draft_weights=0,
                       target_kv_per_token=KV, draft_kv_per_token=0, max_model_len=32768, max_num_seqs=8,
                       prefix_caching=True, row_len=4096, lower_to_fit=True)
    old = plan_memory(budget=20 * GiB, cache_space=4 * GiB, target_weights=GiB, draft_weights=0,
                      target_kv_per_token=KV, draft_kv_per_token=0, max_model_len=4096, max_num_seqs=8,
                      prefix_caching=True)
    assert (plan.max_model_len, plan.max_num_seqs, plan.kv_tokens, plan.budget) == (32768, 8, 32768, 5 * GiB)
    assert plan.prefix_cache_blocks == old.prefix_cache_blocks == (4 * GiB - 32768 * KV) // (16 * KV)
    assert "8 sequences of up to 4096 tokens, or fewer longer ones (1 of up to 32768" in plan.report()
    # 2 sequences: rows still hold one of 32768
    two = plan_memory(budget=20 * GiB, cache_space=4 * GiB, target_weights=GiB, draft_weights=0,
                      target_kv_per_token=KV, draft_kv_per_token=0, max_model_len=32768, max_num_seqs=2,
                      prefix_caching=True, row_len=4096, lower_to_fit=True)
    assert (two.max_num_seqs, two.kv_tokens, two.prefix_cache_blocks) == (2, 32768, plan.prefix_cache_blocks)


def test_a_budget_without_room_for_the_models_context_lowers_it_and_says_so():
    kw = dict(target_weights=GiB, draft_weights=0, target_kv_per_token=KV, draft_kv_per_token=0,
              max_model_len=32768, max_num_seqs=8, prefix_caching=True, row_len=4096)
    plan = plan_memory(budget=GiB + 512 * 1024 ** 2, lower_to_fit=True, **kw)  # 512 MiB: 18724 tokens
    assert (plan.max_model_len, plan.kv_tokens, plan.max_num_seqs) == (18720, 18720, 4)  # 4 rows of 4096 or 1
    assert "lowered from the model's 32768: the memory budget holds one sequence of 18720 tokens" in plan.report()
    with pytest.raises(MemoryBudgetError, match="one sequence of 32768"):  # asked for: refused, not lowered
        plan_memory(budget=GiB + 512 * 1024 ** 2, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_long_rows_for_every_proposer_with_prefix_hits(kind):
    """The same mix for every proposer of the prefix-cache tests (Medusa and EAGLE, chain and tree, keep
    their own K/V rows or none), 4 rows sharing 256 slots, prefix blocks of 8: greedy output == plain."""
    engine = make_engine(kind, chunk=48, blocks=64, batch=4, row_tokens=MAX_LEN, clock=step_clock())
    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in REQUESTS])
    for rid, prompt, n, _ in REQUESTS:
        assert tuple(finals[rid].token_ids) == unbatched(prompt, n), f"request {rid}"
    assert finals["again"].metrics.cached_tokens > 0


def test_one_row_takes_the_pages_a_long_request_needs():
    """A one-sequence engine (as `LLM.engine_for` makes for `specdec bench`): its row holds up to the context."""
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy"), num_speculative_tokens=3,
                    max_model_len=MAX_LEN, row_tokens=MAX_LEN)
    assert engine.cache.batch_size == 1 and engine.cache.capacity >= MAX_LEN
    out = run(engine, [("long", LONG, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))])["long"]
    assert tuple(out.token_ids) == unbatched(LONG, 40)
