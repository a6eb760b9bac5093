"""Prefix caching on tiny random models: a request that finds its prefix cached gives exactly the output it
gives on an engine without a cache (greedy, and seeded sampling, where the draft's state shows in the draft
probabilities that rejection sampling reads), for every proposer and prefill chunk size: the same request
again, the next turn of a conversation (its prefix cached by a different request, through that request's
output), a hit ending inside a block, eviction under memory pressure, and drafts holding fewer blocks than
the target. Plus the block keys, the copies in and out of the pool, and the salt that isolates tenants."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread
from specdec.config import SamplingParams
from specdec.engine import Engine, prefix_cache
from specdec.engine.memory import GiB, plan_memory
from specdec.engine.prefix_cache import PrefixCache, block_keys
from specdec.heads.modules import HeadsConfig, head_class
from specdec.models.kv_cache import KVCache, KVCacheFull
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.draft_model import DraftModelProposer
from specdec.speculative.proposers import NgramProposer
from test_engine_tiny import MAX_LEN, draft, run, target, widths_fed

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

BLOCK = 8
A = tuple((7 * i + 3) % 90 for i in range(37))  # 36 tokens to prefill: 4 whole blocks
OTHER = tuple((11 * i + 5) % 90 for i in range(20))
HEADS = ("medusa", "eagle", "eagle tree")
KINDS = ("plain", "ngram", "draft model", *HEADS)


def params(sampled: bool, seed: int = 0) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.9, top_k=40, max_tokens=16, ignore_eos=True, seed=seed)
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@lru_cache(maxsize=None)
def random_head(method: str):
    """Untrained heads on the tiny target: their drafts are rarely accepted, but their probabilities, which
    seeded rejection sampling reads, change with any difference in what they were fed."""
    torch.manual_seed(3)
    model = target("fp32")
    head = head_class(method)(HeadsConfig.for_target(method, model, "tiny", vocab_size=97, num_heads=3))
    for p in head.parameters():
        p.normal_(0.0, 0.3)
    return head.attach(model).eval()


def make_engine(kind: str, chunk: int = 64, blocks: int = 0, batch: int = 2, block: int = BLOCK, **kw) -> Engine:
    vocab, k = 97, 3
    if kind == "plain":
        proposer, k = None, 0
    elif kind == "ngram":
        proposer = NgramProposer(max_n=3)
    elif kind == "draft model":
        proposer = DraftModelProposer(draft("fp32", "noisy copy"), batch, MAX_LEN)
    elif kind == "medusa":
        proposer = MedusaProposer(random_head("medusa"), vocab, None, max_depth=k)
    else:
        tree = default_tree(k) if kind == "eagle tree" else None
        proposer = EagleProposer(random_head("eagle"), vocab, batch, MAX_LEN, tree, max_depth=k)
    return Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=MAX_LEN,
                  max_batch_size=batch, prefill_chunk=chunk, prefix_cache_blocks=blocks, prefix_block_size=block, **kw)


def cold(kind: str, chunk: int, prompt, p: SamplingParams) -> list[int]:
    """The request alone on an engine without a prefix cache."""
    return run(make_engine(kind, chunk), [("cold", prompt, p)])["cold"].token_ids


def cached(blocks: int, kind: str, tail: int = 0, block: int = BLOCK) -> int:
    """Prompt tokens a hit of `blocks` whole blocks and a `tail` spares: EAGLE takes no tails (they hold no
    pairs of its own), and proposers on the target's features recompute the last token."""
    tokens = blocks * block + (tail if kind not in ("eagle", "eagle tree") else 0)
    return tokens - (kind in HEADS and tokens > 0)


def assert_pages_accounted(engine: Engine) -> dict[str, int]:
    """Every page of every cache is held by as many as its count says (rows, and prefix-cache blocks mapping
    it), and free exactly when none holds it: none is lost, freed twice, or shared without its count. Returns
    the pages the prefix cache holds, by cache."""
    pc, cached = engine.prefix_cache, {}
    for name, cache in {"target": engine.cache, **engine.proposer.kv_caches}.items():
        held = [block.pages[name] for block in pc.blocks.values() if name in block.pages] if pc else []
        holders = Counter(held + [page for row in cache.pages for page in row])
        assert len(set(held)) == len(held) and len(set(cache.free)) == len(cache.free), name
        assert [cache.refs[page] for page in range(cache.num_pages)] == [holders[page] for page in range(cache.num_pages)]
        assert set(cache.free) == {page for page in range(cache.num_pages) if not holders[page]}, name
        assert pc is None or (name in pc.mapped) == (name not in pc.pools), name
        cached[name] = len(held)
    return cached


# ------------------------------------------------------------------------------------------- exactness
# (whole blocks, tail) each request finds, by block size: 8 (copied blocks), 16 (a page: the target's
# blocks and a draft model's are the pages their rows wrote, mapped into the rows that find them)
HITS = {8: {"again": (4, 4), "next turn": (6, 4), "mid-block": (2, 0), "other": (0, 0)},
        16: {"again": (2, 4), "next turn": (3, 4), "mid-block": (1, 0), "other": (0, 0)}}


@pytest.mark.parametrize("block", [8, 16], ids=["copied", "mapped"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_hits_give_the_outputs_of_an_engine_without_a_cache(kind, chunk, sampled, block):
    """A 37-token prompt, then: the same prompt (its first 36 tokens cached when the first request's prompt
    was in: 4 blocks of 8 and a tail of 4), the next turn of that conversation (its first 52 tokens cached by
    the first request through its output: 6 blocks of 8 and a tail of 4), a prompt sharing 21 tokens with the
    first (a hit ending mid-block: 2 blocks of 8, no tail) and one sharing nothing; the last three together in
    a batch of two (a hit restores its row while another sequence decodes, and rows move as they leave). In
    blocks of 16 the same requests find 2 blocks and a tail of 4, 3 and 4, 1 and none: mapped pages, which a
    row that writes past a shared tail copies first. After all, every page is free or held by one block."""
    engine = make_engine(kind, chunk, blocks=64, block=block)
    first = run(engine, [("first", A, params(sampled, 1))])["first"]
    again = run(engine, [("again", A, params(sampled, 2))])["again"]
    prompts = {"again": A, "next turn": A + tuple(first.token_ids) + (5, 6, 7), "mid-block": A[:21] + OTHER[:10],
               "other": OTHER}
    requests = {rid: (prompts[rid], params(sampled, seed), HITS[block][rid])
                for seed, rid in enumerate(prompts, start=2)}
    outs = {"again": again, **run(engine, [(rid, *requests[rid][:2]) for rid in ("next turn", "mid-block", "other")])}
    assert first.metrics.cached_tokens == 0 and first.token_ids == cold(kind, chunk, A, params(sampled, 1))
    for rid, (prompt, p, (blocks, tail)) in requests.items():
        assert outs[rid].metrics.cached_tokens == cached(blocks, kind, tail, block), rid
        assert outs[rid].token_ids == cold(kind, chunk, prompt, p), rid
    assert engine.metrics.cached_tokens == sum(cached(hit[0], kind, hit[1], block) for *_, hit in requests.values())
    held = assert_pages_accounted(engine)
    assert all((count > 0) == (name in engine.prefix_cache.mapped) for name, count in held.items())


@pytest.mark.parametrize("kind", ["plain", "draft model", "eagle"])
def test_eviction_under_memory_pressure_takes_the_least_recently_used_tails_first(kind):
    """A pool of 6 blocks of 8 tokens. X (25 tokens, 8 out) leaves 4 blocks; Y takes 4 more, evicting X's
    last two; X again finds 2 blocks, and takes back 2 by evicting Y's tail; Y again finds 2. A 70-token
    prompt needs 8 blocks: its chain is cut at 6 (it never evicts its own blocks), which it finds again."""
    engine = make_engine(kind, blocks=6)
    x, y = A[:25], OTHER + A[:5]
    z = tuple((5 * i + 1) % 90 for i in range(70))
    p = SamplingParams(temperature=0.9, top_k=40, max_tokens=8, ignore_eos=True, seed=7)
    expected_blocks = [0, 0, 2, 2, 0, 6]
    for i, (prompt, blocks) in enumerate(zip([x, y, x, y, z, z], expected_blocks)):
        out = run(engine, [(str(i), prompt, p)])[str(i)]
        assert out.metrics.cached_tokens == cached(blocks, kind), f"request {i}"
        assert out.token_ids == cold(kind, 64, prompt, p), f"request {i}"
    assert len(engine.prefix_cache.blocks) == 6


def test_a_draft_model_holding_fewer_blocks_reads_the_rest_itself():
    """The target's 4 blocks of A and its tail of 4 are cached but the draft's first block only (as when its
    row had restarted on a window): a hit restores the target's 36 tokens and the draft reads tokens 8..35
    itself, then the prompt's rest with the target's chunk; seeded sampling gives the cold output."""
    engine = make_engine("draft model", blocks=64)
    run(engine, [("first", A, params(True, 1))])
    pc = engine.prefix_cache
    for block in pc.lookup(pc.keys(A[:-1]))[1:]:
        block.caches.discard("draft")
    fed, original = widths_fed(engine.proposer.model)
    try:
        out = run(engine, [("again", A, params(True, 2))])["again"]
    finally:
        engine.proposer.model.forward = original
    assert fed[:2] == [28, 1]
    assert out.metrics.cached_tokens == 36 and out.token_ids == cold("draft model", 64, A, params(True, 2))


def test_eagle_pairs_bound_the_hit():
    """EAGLE's pairs cannot be recomputed without the features of the whole prefix: with its pairs cached for
    2 of the 4 blocks of A, the hit is 2 blocks (less the token the target recomputes)."""
    engine = make_engine("eagle", blocks=64)
    run(engine, [("first", A, params(True, 1))])
    pc = engine.prefix_cache
    for block in pc.lookup(pc.keys(A[:-1]))[2:]:
        block.caches.discard("draft")
    out = run(engine, [("again", A, params(True, 2))])["again"]
    assert out.metrics.cached_tokens == 15 and out.token_ids == cold("eagle", 64, A, params(True, 2))


def test_a_draft_that_skips_the_prompt_is_restored_nothing():
    """disable_by_batch_size 1: a prompt joining with another waiting is not read by the draft model, which
    restarts on a window once it drafts. A hit must leave it so (not restore its cached blocks, from which it
    would catch up on the whole context instead), and a row restarted on a window has no draft blocks to save:
    a later request extending it restores the first request's 4 draft blocks and reads on from there. Seeded
    outputs equal those of an engine without a cache given the same requests."""
    def session(blocks: int) -> dict:
        engine = make_engine("draft model", blocks=blocks, disable_by_batch_size=1)
        outs = run(engine, [("first", A, params(True, 1))])
        short = SamplingParams(temperature=0.9, top_k=40, max_tokens=2, ignore_eos=True, seed=3)
        longer = SamplingParams(temperature=0.9, top_k=40, max_tokens=40, ignore_eos=True, seed=2)
        outs |= run(engine, [("again", A + (1, 2, 3, 4), longer), ("short", OTHER, short)])
        later = A + (1, 2, 3, 4) + tuple(outs["again"].token_ids) + (9,)
        return outs | run(engine, [("later", later, params(True, 4))])

    hit, without = session(64), session(0)
    assert hit["again"].metrics.cached_tokens == 36 and hit["again"].metrics.num_drafts > 0  # 4 blocks, a tail of 4
    assert hit["later"].metrics.cached_tokens == 80
    assert {r: o.token_ids for r, o in hit.items()} == {r: o.token_ids for r, o in without.items()}


@pytest.mark.parametrize("block", [8, 16], ids=["copied", "mapped"])
@pytest.mark.parametrize("kind", ["plain", "draft model"])
def test_a_prompt_is_shared_once_prefilled_while_its_request_runs(kind, block):
    """b finds a's prompt (36 tokens) while a runs; in blocks of 16 both rows hold the same pages, and each
    copies the shared tail page before writing its first token there."""
    engine = make_engine(kind, blocks=64, block=block)
    outs = run(engine, [("a", A, params(False)), ("b", A, params(False))])
    assert [outs[r].metrics.cached_tokens for r in "ab"] == [0, 36] and outs["a"].token_ids == outs["b"].token_ids
    assert outs["a"].token_ids == cold(kind, 64, A, params(False))
    assert_pages_accounted(engine)


@pytest.mark.parametrize("kind", ["plain", "draft model", "eagle"])
def test_mapped_blocks_under_memory_pressure_give_their_pages_back(kind):
    """4 blocks of 16 (each a page of the target's pool set aside for them) and prompts of 1 to 5 blocks, some
    again: evicted blocks give their pages back, hits give the outputs of an engine without a cache, and at
    the end every page is free or held once."""
    engine = make_engine(kind, blocks=4, block=16)
    z = tuple((5 * i + 1) % 90 for i in range(80))
    p = SamplingParams(temperature=0.9, top_k=40, max_tokens=8, ignore_eos=True, seed=7)
    hits = []
    for i, prompt in enumerate([A, OTHER, A, z, z, A[:21], OTHER]):
        out = run(engine, [(str(i), prompt, p)])[str(i)]
        assert out.token_ids == cold(kind, 64, prompt, p), f"request {i}"
        hits.append(out.metrics.cached_tokens)
        assert_pages_accounted(engine)
    assert len(engine.prefix_cache.blocks) == 4 and engine.cache.prefix_pages == 4
    assert hits[0] == 0 and hits[2] > 0 and hits[4] > 0


def test_a_cache_salt_shares_prefixes_only_with_the_same_salt():
    engine = make_engine("plain", blocks=64)
    p = params(False)
    salts = [None, "tenant-1", "tenant-1", "tenant-2", None]
    outs = []
    for salt in salts:
        engine.add_request("r", list(A), p, cache_salt=salt)
        while engine.has_unfinished_requests():
            outs += [out for out in engine.step() if out.finished]
    assert [o.metrics.cached_tokens for o in outs] == [0, 0, 36, 0, 36]
    assert all(o.token_ids == outs[0].token_ids for o in outs)


def test_isolation_by_salt_gives_unsalted_requests_no_cache_at_all():
    """`prefix_isolation="salt"` (--prefix-caching-isolation salt): unsalted requests neither read nor feed the
    cache (cached_tokens tells nothing of another's prompt), salted ones share with their salt as before."""
    engine = make_engine("plain", blocks=64, prefix_isolation="salt")
    p = params(False)
    outs = []
    for salt in [None, None, "tenant-1", "tenant-1", None]:
        engine.add_request("r", list(A), p, cache_salt=salt)
        while engine.has_unfinished_requests():
            outs += [out for out in engine.step() if out.finished]
    assert [o.metrics.cached_tokens for o in outs] == [0, 0, 0, 36, 0]
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    with pytest.raises(ValueError, match="prefix_isolation"):
        make_engine("plain", blocks=64, prefix_isolation="per-key")


def test_a_request_for_prompt_logprobs_prefills_its_whole_prompt():
    """Prompt logprobs need the logits of every prompt position: such a request takes nothing from the cache
    (vLLM does the same) and gets the prompt logprobs and output logprobs of an engine without one; the
    next request without them hits again."""
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    engine = make_engine("draft model", blocks=64)
    run(engine, [("first", A, params(False))])
    outs = run(engine, [("logprobs", A, p)]) | run(engine, [("after", A, params(False))])
    reference = run(make_engine("draft model"), [("cold", A, p)])["cold"]
    assert outs["logprobs"].metrics.cached_tokens == 0 and outs["after"].metrics.cached_tokens == 36
    assert outs["logprobs"].prompt_logprobs == reference.prompt_logprobs
    assert outs["logprobs"].logprobs == reference.logprobs and outs["logprobs"].token_ids == reference.token_ids


@pytest.mark.parametrize("fault", ["judging", "detokenizing", "prefilling"])
def test_a_sequence_that_fails_leaves_the_cache_exact(fault, monkeypatch):
    """A request that fails midway (see test_engine_tiny.inject) saves nothing when released (its row may be
    half-written: one failing in its prefill, after 2 of its 4 blocks, leaves none); what it saved when its
    prompt was in still serves: the same prompt and the next turn of the conversation give the outputs of an
    engine without a cache."""
    from test_engine_tiny import inject

    engine = make_engine("draft model", chunk=8, blocks=64)
    inject(engine, fault, monkeypatch, at=3 if fault == "prefilling" else 2)
    bad = run(engine, [("bad", A, params(True, 1))])["bad"]
    assert bad.finish_reason == "abort" and bad.error is not None
    pc = engine.prefix_cache
    saved = len(pc.lookup(pc.keys(list(A) + bad.token_ids)))
    assert saved == (0 if fault == "prefilling" else 4)  # its prompt's blocks if it joined; none past them
    for rid, prompt in [("same", A), ("next turn", A + tuple(bad.token_ids) + (5, 6, 7))]:
        out = run(engine, [(rid, prompt, params(True, 2))])[rid]
        assert out.token_ids == cold("draft model", 8, prompt, params(True, 2)), rid


# ------------------------------------------------------------------------------------------- the pool
@pytest.mark.parametrize("kind", ["plain", "draft model", "eagle"])
def test_mapped_caches_hold_the_prefix_cache_blocks_in_their_own_pools(kind):
    """Blocks of a page: the target's cache and a draft model's have their pools grown by the blocks (rows are
    admitted to all of it, evicting blocks no row holds) and no pool of their own in the prefix cache; EAGLE's
    pairs (shift 1) keep theirs."""
    base, engine = make_engine(kind, block=16), make_engine(kind, blocks=64, block=16)
    caches = {"target": (base.cache, engine.cache)}
    caches |= {name: (base.proposer.kv_caches[name], own) for name, own in engine.proposer.kv_caches.items()}
    for name, (without, cache) in caches.items():
        mapped = name == "target" or kind == "draft model"
        assert cache.num_pages == without.num_pages + 64 * mapped and cache.row_pages == cache.num_pages, name
        assert (cache.reclaim is not None) == mapped, name
        assert (name in engine.prefix_cache.pools) != mapped and (name in engine.prefix_cache.mapped) == mapped
    assert make_engine(kind, blocks=64).prefix_cache.mapped == {}  # blocks of 8: copied


def test_block_keys_cover_the_whole_prefix_and_the_salt():
    keys = block_keys(list(A), 8)
    assert len(keys) == 4 and len(set(keys)) == 4  # whole blocks only: 37 tokens, 4 keys
    assert block_keys(list(A[:16]), 8) == keys[:2]
    changed = block_keys([A[0] + 1, *A[1:]], 8)  # the first token changes every block's key
    assert not set(changed) & set(keys)
    salted = block_keys(list(A), 8, "s")
    assert not set(salted) & set(keys) and salted == block_keys(list(A), 8, "s") != block_keys(list(A), 8, "t")


def random_rows(block_size: int = 8) -> tuple[KVCache, KVCache, PrefixCache]:
    """A cache of 2 rows of random K/V (row 0 in pages 0..3, row 1 in the pool's last 4 pages, backwards), an
    empty one of 1 row, and a pool of 4 blocks of `block_size` for the first ("x")."""
    config = target("fp32").config
    src, dst = KVCache(config, 2, 64, torch.float32), KVCache(config, 1, 64, torch.float32)
    src.reserve(0, 64)
    src.free.reverse()  # row 1's pages: 4, 5, 6, 7 taken from the other end
    src.reserve(1, 64)
    assert src.pages == [[0, 1, 2, 3], [7, 6, 5, 4]]
    gen = torch.Generator().manual_seed(0)
    for t in src.keys + src.values:
        t.copy_(torch.randn(t.shape, generator=gen))
    return src, dst, PrefixCache({"x": src}, num_blocks=4, block_size=block_size)


def slots(cache: KVCache, layer_cache: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """The first `n` slots of `row` of one layer's keys or values: [kv_heads, n, head_dim]."""
    return cache.gather(layer_cache, row + 1, n)[row]


@pytest.mark.parametrize("block_size,shift", [(8, 0), (8, 1), (16, 0), (16, 1)])
def test_saved_blocks_load_back_the_slots_they_were_copied_from(block_size, shift):
    """Three blocks of row 1 saved, loaded into row 0 of another cache: the same bits in slots
    [0, 3 * block_size - shift) (shift 1: block i holds slots [8i - 1, 8i + 7), EAGLE's pairs), and the row's
    length set. Blocks of a page (16) with shift 0 are copied page by page, the others slot by slot."""
    src, dst, pc = random_rows(block_size)
    n = 3 * block_size - shift
    keys = block_keys(list(range(60)), block_size)[:3]
    pc.save("x", keys, src, 1, shift)
    assert pc.load("x", pc.lookup(keys), dst, 0, shift) == n == dst.lengths[0]
    for a, b in zip(src.keys + src.values, dst.keys + dst.values):
        assert torch.equal(slots(dst, b, 0, n), slots(src, a, 1, n))


def test_a_mapped_block_is_the_page_its_row_wrote_and_a_write_copies_a_shared_page():
    """Row 1's 40 slots saved in blocks of a page: 2 whole blocks and a tail of 8, each the row's own page,
    held (refs 2). The row leaves: its pages stay cached (refs 1). Row 0 finds them: they are mapped, not
    copied (refs 2), and read the same bits. Row 0 writing slot 40 (in the tail's page) gets a copy of that
    page first, so the cached page keeps its bits; truncated into its second page and writing there, it copies
    that page too, never the first. Cleared, the prefix cache gives every page back."""
    src, _, _ = random_rows()
    cache = KVCache(target("fp32").config, 2, 64, torch.float32)
    cache.prefix_pages = 3
    cache.reserve(1, 40)
    for a, b in zip(src.keys + src.values, cache.keys + cache.values):
        b.copy_(a)
    cache.advance(1, 40)
    pc = PrefixCache({"x": cache}, num_blocks=3, block_size=16, mapped=("x",))
    tokens = list(range(40))
    keys = pc.keys(tokens, tail=True)
    pc.save("x", keys, cache, 1, tail=8)
    pages = list(cache.pages[1])
    assert [pc.blocks[key].pages["x"] for key in keys] == pages and [cache.refs[q] for q in pages] == [2, 2, 2]
    before = [slots(cache, kv, 1, 40).clone() for kv in cache.keys + cache.values]
    free = len(cache.free)
    cache.clear(1)
    assert len(cache.free) == free and [cache.refs[q] for q in pages] == [1, 1, 1]
    tail = pc.tail("x", keys[:2], tokens[32:] + [99])
    assert pc.load("x", pc.lookup(keys), cache, 0, tail=tail) == 40 == cache.lengths[0]
    assert cache.pages[0] == pages and [cache.refs[q] for q in pages] == [2, 2, 2] and len(cache.free) == free
    assert all(torch.equal(slots(cache, kv, 0, 40), b) for kv, b in zip(cache.keys + cache.values, before))

    cache.reserve(0, 41)  # a pass writing slot 40
    assert cache.pages[0][:2] == pages[:2] and cache.pages[0][2] not in pages and cache.refs[pages[2]] == 1
    assert cache.table[0, 2] == cache.pages[0][2]
    for kv in cache.keys + cache.values:
        kv[cache.pages[0][2], :, 8:] = 7.0  # slot 40 and on, in the row's copy
    assert all(torch.equal(slots(cache, kv, 0, 40), b) for kv, b in zip(cache.keys + cache.values, before))
    cache.truncate(0, 20)
    cache.reserve(0, 22)  # writing slots 20, 21: page 1 copied, page 0 kept
    assert cache.pages[0][0] == pages[0] and cache.pages[0][1] not in pages and cache.refs[pages[1]] == 1
    cache.clear(0)
    assert pc.load("x", pc.lookup(keys), cache, 1, tail=tail) == 40  # the cached pages kept their bits
    assert all(torch.equal(slots(cache, kv, 1, 40), b) for kv, b in zip(cache.keys + cache.values, before))
    cache.clear(1)
    pc.clear()
    assert sorted(cache.free) == list(range(cache.num_pages)) and not any(cache.refs)


def test_a_block_whose_page_a_row_holds_is_not_evicted():
    """2 blocks, both pages of row 1, which still runs: saving row 0's blocks evicts neither (it would free no
    memory) and keeps none of row 0's; once row 1 leaves, the same save evicts them, least recently used first."""
    cache = KVCache(target("fp32").config, 2, 64, torch.float32)
    cache.prefix_pages = 2
    pc = PrefixCache({"x": cache}, num_blocks=2, block_size=16, mapped=("x",))
    for row in (0, 1):
        cache.reserve(row, 32)
        cache.advance(row, 32)
    kept, other = pc.keys(list(range(32))), pc.keys(list(range(100, 132)))
    pc.save("x", kept, cache, 1)
    assert pc.shared("x", cache.pages[1]) == 2 and pc.shared("x", cache.pages[0]) == 0
    pc.save("x", other, cache, 0)
    assert len(pc.lookup(kept)) == 2 and pc.lookup(other) == []
    cache.clear(1)
    pc.save("x", other, cache, 0)
    assert pc.lookup(kept) == [] and len(pc.lookup(other)) == 2
    assert pc.shared("x", cache.pages[0]) == 2 and pc.held_pages["x"] == set(cache.pages[0])


def test_a_row_short_of_pages_evicts_the_blocks_no_row_holds():
    """8 pages, 4 set aside for 4 blocks. Row 1 writes 32 slots (2 pages), kept as 2 blocks, and leaves; row 0
    keeps 2 blocks of its own 32 and runs on. Row 0 then takes the 4 free pages, and for each page more evicts
    a block no row holds (row 1's, the deeper first); its own blocks stay: asking for a page more than free and
    evictable ones is refused. Saving row 0's next blocks takes the evicted blocks back, and no more."""
    cache = KVCache(target("fp32").config, 2, 192, torch.float32, num_pages=8)
    cache.prefix_pages = 4
    pc = PrefixCache({"x": cache}, num_blocks=4, block_size=16, mapped=("x",))
    old, own = pc.keys(list(range(32))), pc.keys(list(range(100, 132)))
    for row, keys in ((1, old), (0, own)):
        cache.reserve(row, 32)
        cache.advance(row, 32)
        pc.save("x", keys, cache, row)
    cache.clear(1)
    assert len(cache.free) == 4 and cache.row_pages == 8 and pc.pinned("x") == 2
    cache.reserve(0, 96)
    assert len(cache.pages[0]) == 6 and len(cache.free) == 0 and len(pc.lookup(old)) == 2
    cache.reserve(0, 112)
    assert len(pc.lookup(old)) == 1 and len(cache.pages[0]) == 7
    cache.reserve(0, 128)
    assert pc.lookup(old) == [] and len(cache.pages[0]) == 8
    with pytest.raises(KVCacheFull):
        cache.reserve(0, 144)
    assert len(pc.lookup(own)) == 2 and len(cache.pages[0]) == 8
    cache.advance(0, 96)
    pc.save("x", pc.keys(list(range(100, 228))), cache, 0)  # 8 blocks asked: the 2 spare ones taken, then cut
    assert len(pc.blocks) == 4 and pc.pinned("x") == 4 and len(pc.lookup(pc.keys(list(range(100, 228))))) == 4


def test_a_mapped_cache_is_refused_what_it_cannot_hold():
    cache = KVCache(target("fp32").config, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="set 3 pages aside"):
        PrefixCache({"x": cache}, num_blocks=3, block_size=16, mapped=("x",))
    cache.prefix_pages = 3
    with pytest.raises(ValueError, match="cannot be pages"):
        PrefixCache({"x": cache}, num_blocks=3, block_size=8, mapped=("x",))
    pc = PrefixCache({"x": cache}, num_blocks=3, block_size=16, mapped=("x",))
    cache.reserve(1, 32)
    cache.advance(1, 32)
    keys = pc.keys(list(range(32)))
    with pytest.raises(ValueError, match="shift 0"):
        pc.save("x", keys, cache, 1, shift=1)
    pc.save("x", keys, cache, 1)
    other = KVCache(target("fp32").config, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="pages of the cache it was created with"):
        pc.load("x", pc.lookup(keys), other, 0)
    with pytest.raises(ValueError, match="cannot map"):
        cache.map(1, [0])
    with pytest.raises(ValueError, match="shared"):
        cache.reshape(2, 64)


def test_runs_of_consecutive_block_ids():
    assert prefix_cache._runs([4, 5, 6, 0, 9, 10]) == [(0, 4, 3), (3, 0, 1), (4, 9, 2)]
    assert prefix_cache._runs([1, 0]) == [(0, 1, 1), (1, 0, 1)] and prefix_cache._runs([]) == []
    assert prefix_cache._runs([4, 5, 6, 0, 9, 10], [0, 1, 3, 4, 5, 6]) == [(0, 4, 2), (2, 6, 1), (3, 0, 1), (4, 9, 2)]


@pytest.mark.parametrize("max_runs", [8, 1], ids=["by-runs", "gathered"])
def test_blocks_saved_into_evicted_blocks_out_of_order_load_back_the_same_bits(max_runs, monkeypatch):
    """A full pool hands out its least recently used blocks: a chain saved then lands in blocks 1 and 0 (not a
    run of the pool), copied layer by layer into them; it loads back the same bits, and so does a chain
    saved from a later block on (its first block already held). Copied run by run of the pool's blocks, and
    (max_runs 1) with the pool's blocks gathered in one copy."""
    monkeypatch.setattr(prefix_cache, "MAX_RUNS", max_runs)
    src, dst, pc = random_rows()
    a, b, c = (block_keys(list(range(start, start + 16)), 8) for start in (100, 200, 300))
    pc.save("x", a, src, 0)
    pc.save("x", b, src, 1)
    assert [pc.blocks[key].id for key in a + b] == [0, 1, 2, 3]
    pc.save("x", c, src, 1)  # evicts a's deeper block first (id 1), then its first (id 0)
    assert [pc.blocks[key].id for key in c] == [1, 0]
    assert pc.load("x", pc.lookup(c), dst, 0) == 16
    for x, y in zip(src.keys + src.values, dst.keys + dst.values):
        assert torch.equal(slots(dst, y, 0, 16), slots(src, x, 1, 16))
    longer = block_keys(list(range(300, 324)), 8)  # c's 2 blocks and a third: only the third is copied
    assert longer[:2] == c
    pc.save("x", longer, src, 1)
    assert pc.load("x", pc.lookup(longer), dst, 0) == 24
    for x, y in zip(src.keys + src.values, dst.keys + dst.values):
        assert torch.equal(slots(dst, y, 0, 24), slots(src, x, 1, 24))


def test_a_tail_is_found_only_whole_and_loads_back_its_slots():
    """Row 1's first 21 slots saved: 2 blocks of 8 and a tail of 5. A prompt whose next tokens after the 2
    blocks are the tail's 5 and more finds it (21 slots load back, the same bits); one that differs in the
    tail's 3rd token, or that has only 3 of its tokens, finds no tail (never a part of one: a match token by
    token would let a client read another's prompt one token per guess); after another block, no tail."""
    src, dst, pc = random_rows()
    tokens = list(range(40, 61))  # 21
    keys = pc.keys(tokens, tail=True)
    assert len(keys) == 3 and keys[:2] == block_keys(tokens, 8) and pc.keys(tokens[:16], tail=True) == keys[:2]
    pc.save("x", keys, src, 1, tail=5)
    assert len(pc.lookup(keys)) == 2  # a tail's key never extends a chain of whole blocks
    tail = pc.tail("x", keys[:2], tokens[16:] + [7, 7])
    assert tail is not None and tail.size == 5
    assert list(pc.blocks)[-3:] == [keys[2], keys[1], keys[0]]  # touched as the chain's deepest block
    assert pc.tail("x", keys[:2], tokens[16:18] + [0] + tokens[19:]) is None
    assert pc.tail("x", keys[:2], tokens[16:19]) is None and pc.tail("x", keys[:1], tokens[8:]) is None
    assert pc.tail("y", keys[:2], tokens[16:]) is None  # (a cache it does not hold)
    assert pc.load("x", pc.lookup(keys), dst, 0, tail=tail) == 21 == dst.lengths[0]
    for a, b in zip(src.keys + src.values, dst.keys + dst.values):
        assert torch.equal(slots(dst, b, 0, 21), slots(src, a, 1, 21))
    short = [9, 8, 7]  # a sequence shorter than a block: a tail after no block, salted apart
    pc.save("x", pc.keys(short, "s", tail=True), src, 0, tail=3)
    assert pc.tail("x", [], short + [1]) is None
    assert pc.load("x", [], dst, 0, tail=pc.tail("x", [], short + [1], "s")) == 3
    assert torch.equal(slots(dst, dst.keys[0], 0, 3), slots(src, src.keys[0], 0, 3))


def test_the_memory_plan_gives_the_prefix_cache_what_the_sequences_leave():
    plan = plan_memory(10 * GiB, 2 * GiB, GiB, 28 * 1024, 12 * 1024, 4096, max_num_seqs=8, prefix_caching=True)
    rest = 10 * GiB - 3 * GiB - 8 * 4096 * 40 * 1024
    assert plan.prefix_cache_blocks == rest // (16 * 40 * 1024) and 0 <= rest - plan.prefix_cache < 16 * 40 * 1024
    assert f"({plan.prefix_cache_blocks} blocks of 16 tokens)" in plan.report()
    off = plan_memory(10 * GiB, 2 * GiB, GiB, 28 * 1024, 12 * 1024, 4096, max_num_seqs=8)
    assert off.prefix_cache_blocks == 0 and off.max_num_seqs == 8
    assert "prefix cache       0.000 GiB  (off)" in off.report()
    # a draft model's K/V and the target's keep blocks as pages: rows may take them (an EAGLE head's may not)
    more = f"and up to {8 * 4096 + 16 * plan.prefix_cache_blocks} tokens by taking the prefix cache's pages"
    assert more in plan.report() and "by taking" not in off.report()
    eagle = plan_memory(10 * GiB, 2 * GiB, GiB, 28 * 1024, 12 * 1024, 4096, max_num_seqs=8, prefix_caching=True,
                        draft_label="heads")
    medusa = plan_memory(10 * GiB, 2 * GiB, GiB, 28 * 1024, 0, 4096, max_num_seqs=8, prefix_caching=True,
                         draft_label="heads")
    assert "by taking" not in eagle.report() and "by taking" in medusa.report()
