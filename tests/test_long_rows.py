"""Rows that trade number for length (issue 31's interim for paged K/V): short sequences run `max_batch_size`
at once in short rows, a long one in fewer, longer rows of the same slots, with the requests behind it
waiting. Greedy outputs stay exactly the unbatched plain ones (every proposer kind with a cache of its own
or none, with and without prefix-cache hits); the memory plan serves the model's whole context by default
without taking the prefix cache or the batch of short requests, and lowers it only when one sequence does
not fit."""

from __future__ import annotations

import itertools

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.engine.memory import GiB, MemoryBudgetError, plan_memory
from specdec.models.kv_cache import KVCache
from test_engine_tiny import MAX_LEN, make_proposer, run, target
from test_prefix_cache import KINDS, make_engine

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
    for k in cache.keys:
        k.normal_()
    cache.lengths = [30, 0, 0, 0]
    before = [k[0, :, :30].clone() for k in cache.keys]
    cache.reshape(1, 200)
    assert (cache.batch_size, cache.capacity, cache.lengths) == (1, 256, [30])  # whole key blocks of 64
    assert all(torch.equal(k[0, :, :30], b) for k, b in zip(cache.keys, before))
    cache.reshape(4, 64)
    assert (cache.batch_size, cache.capacity, cache.lengths) == (4, 64, [30, 0, 0, 0])
    assert all(torch.equal(k[0, :, :30], b) for k, b in zip(cache.keys, before))
    cache.lengths = [30, 5, 0, 0]
    with pytest.raises(ValueError, match="cannot reshape"):
        cache.reshape(1, 256)  # row 1 holds tokens
    cache.lengths = [100, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot reshape"):
        cache.reshape(4, 64)  # row 0 is longer than that


@pytest.mark.parametrize("prefix_blocks", [0, 64], ids=["no prefix cache", "prefix cache"])
@pytest.mark.parametrize("kind,k", [("plain", 0), ("ngram", 3), ("noisy copy", 4)])
def test_a_long_sequence_among_short_ones_keeps_every_output_exact(kind, k, prefix_blocks):
    """4 rows of 64 slots share 256: the long request waits for the batch to empty, runs alone in one row
    of 256, the short ones behind it wait, and the rows go back to 4 when it leaves."""
    proposer = None if kind == "plain" else make_proposer("fp32", kind, max_batch_size=4)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, k, max_model_len=MAX_LEN, max_batch_size=4,
                    row_tokens=MAX_LEN, prefix_cache_blocks=prefix_blocks, prefix_block_size=8, prefill_chunk=48)
    short_rows = (engine.cache.batch_size, engine.cache.capacity)
    assert short_rows[0] == 4 and short_rows[1] < len(LONG)
    shapes, batches = [], []

    def on_step(_outputs):
        shapes.append((engine.cache.batch_size, engine.cache.capacity))
        batches.append(len(engine.running) + (engine.prefilling is not None))
        assert engine.cache.batch_size * engine.cache.capacity <= 4 * short_rows[1]  # never more slots
        if engine.proposer.cache is not None:
            assert engine.proposer.cache.batch_size == engine.cache.batch_size

    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in REQUESTS], on_step=on_step)
    for rid, prompt, n, _ in REQUESTS:
        assert tuple(finals[rid].token_ids) == unbatched(prompt, n), f"request {rid}"
    long_rows = [(rows, slots) for rows, slots in shapes if slots >= len(LONG) + 40]
    assert long_rows and all(rows < 4 for rows, _ in long_rows)
    assert shapes[0] == short_rows
    after = run(engine, [("e", (5, 5, 5, 5), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])
    assert (engine.cache.batch_size, engine.cache.capacity) == short_rows  # and back, at the next join
    assert tuple(after["e"].token_ids) == unbatched((5, 5, 5, 5), 12)
    assert max(b for b, shape in zip(batches, shapes) if shape == short_rows) == 2  # a, b; then c, d
    assert finals["again"].metrics.cached_tokens == (len(LONG) - 1) * (prefix_blocks > 0)  # blocks and a tail


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
    ticks = itertools.count()  # (a clock of steps, not seconds: the riding chunks' sizes, and so which prefix
    # blocks are still cached when "again" joins, do not follow the machine's load)
    engine = make_engine(kind, chunk=48, blocks=64, batch=4, row_tokens=MAX_LEN, clock=lambda: float(next(ticks)))
    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in REQUESTS])
    for rid, prompt, n, _ in REQUESTS:
        assert tuple(finals[rid].token_ids) == unbatched(prompt, n), f"request {rid}"
    assert finals["again"].metrics.cached_tokens > 0


def test_one_row_starts_short_and_grows_for_a_long_request():
    """A one-sequence engine (as `LLM.engine_for` makes for `specdec bench`) with rows of 64 of 256 slots."""
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy"), 3, max_model_len=MAX_LEN,
                    row_tokens=MAX_LEN, row_len=64)
    assert (engine.cache.batch_size, engine.cache.capacity) == (1, 128)  # 64 + the widest draft, whole blocks
    out = run(engine, [("long", LONG, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))])["long"]
    assert engine.cache.capacity >= len(LONG) + 40 and tuple(out.token_ids) == unbatched(LONG, 40)
