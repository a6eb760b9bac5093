"""The attention kernel (kernels/csrc/ops/attention.cpp, op `attention` of the block kernels' library).

Bits: every output equals, bit for bit, `reference_attention` below, a slow torch transcription of the
recipe the kernel documents (lane dot products, blocks of 64 keys, their sums combined in order), but for bf16
on the AMX build's tiles (`on_tiles`: a recipe of their own, checked against softmax attention within the
output's rounding); and a query's bits do not depend on the call: the number of rows, its row's position, the
batch, chunked or whole prefill, masked key slots, the thread count, or tiles shared across rows vs a tree's
gathered keys.
"""

from __future__ import annotations

import pytest
import torch

from specdec.kernels import qgemm

BLOCK = 64  # keys per block of the kernel's sums
F32 = torch.float32


def _f(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def exp_nonpositive(x: torch.Tensor) -> torch.Tensor:
    """The kernel's exp for x <= 0, operation by operation (each one rounded to fp32, none fused)."""
    v = torch.clamp(x, min=-87.0)
    r = (v * _f(1.44269504088896341) + _f(12582912.0)) - _f(12582912.0)
    f = v - r * _f(0.693359375)
    f = f - r * _f(-2.12194440e-4)
    p = torch.full_like(f, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * f + _f(c)
    p = (p * (f * f) + f) + _f(1.0)
    scale = ((r.to(torch.int32) + 127) << 23).view(F32)
    return p * scale


def reference_attention(q, keys, values, visible, key_index=None):
    """q [B, T, H, D]; keys, values [rows, KV, capacity, D]; visible [B, T, S] bool; key_index [B, T, S] or
    None -> [B, T, H, D]: each query alone, as the kernel's comment defines its bits."""
    B, T, H, D = q.shape
    G = H // keys.shape[1]
    scale = _f(1.0) / torch.sqrt(_f(float(D)))
    out = torch.zeros(B, T, H, D, dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            seen = visible[b, t].nonzero()[:, 0]
            slots = key_index[b, t, seen] if key_index is not None else seen
            n = len(slots)
            if n == 0:
                continue
            k = keys[b, :, slots].float().repeat_interleave(G, 0)  # [H, n, D]
            v = values[b, :, slots].float().repeat_interleave(G, 0)
            prod = q[b, t].float()[:, None, :] * k  # [H, n, D]
            lanes = torch.zeros(H, n, 8)
            for d in range(0, D, 8):  # lane l: dims l, l + 8, ... in order (a tail in the first lanes)
                w = min(8, D - d)
                lanes[..., :w] = lanes[..., :w] + prod[..., d:d + w]
            l_ = lanes.unbind(-1)
            s = (((l_[0] + l_[1]) + (l_[2] + l_[3])) + ((l_[4] + l_[5]) + (l_[6] + l_[7]))) * scale  # [H, n]
            for c in range(0, n, BLOCK):
                sb = s[:, c:c + BLOCK]
                top = sb.amax(-1)  # [H]
                e = exp_nonpositive(sb - top[:, None])
                bsum, bacc = torch.zeros(H), torch.zeros(H, D)
                for j in range(e.shape[1]):
                    bsum = bsum + e[:, j]
                    bacc = bacc + e[:, j, None] * v[:, c + j]
                if c == 0:
                    m, total, acc = top, bsum, bacc
                    continue
                grows = top > m  # the running sums scaled down, else the block's
                alpha, beta = exp_nonpositive(m - top), exp_nonpositive(top - m)
                total = torch.where(grows, total * alpha + bsum, total + bsum * beta)
                acc = torch.where(grows[:, None], acc * alpha[:, None] + bacc, acc + bacc * beta[:, None])
                m = torch.maximum(m, top)
            out[b, t] = (acc / total[:, None]).to(q.dtype)
    return out


def softmax_attention(q, keys, values, visible, key_index=None):
    """Softmax attention in float64 (the value the recipes round), and the weighted sums of |v| (the scale of
    its terms): two tensors in q's layout."""
    B, T, H, D = q.shape
    G = H // keys.shape[1]
    out, mag = torch.zeros(B, T, H, D, dtype=torch.float64), torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            seen = visible[b, t].nonzero()[:, 0]
            slots = key_index[b, t, seen] if key_index is not None else seen
            if len(slots) == 0:
                continue
            k = keys[b, :, slots].double().repeat_interleave(G, 0)  # [H, n, D]
            v = values[b, :, slots].double().repeat_interleave(G, 0)
            w = torch.softmax(torch.einsum("hd,hnd->hn", q[b, t].double(), k) / D ** 0.5, -1)
            out[b, t], mag[b, t] = torch.einsum("hn,hnd->hd", w, v), torch.einsum("hn,hnd->hd", w, v.abs())
    return out, mag


def on_tiles(dtype, D) -> bool:
    """Whether this build computes bf16 attention of head size D on the tile unit (the AMX build:
    kernels/csrc/amx/attention.h), whose recipe (the unit's dot products, weights rounded to bf16) has
    bits of its own; every other call is `reference_attention`'s recipe."""
    return dtype == torch.bfloat16 and qgemm.ops().attention_tiles(D)


def check_recipe(out, q, keys, values, visible, key_index=None):
    """`out` is the build's recipe: `reference_attention` bit for bit, or, on tiles, softmax attention within
    the output's own rounding (half a bf16 step) and 2^-8 of its terms' scale (the weights rounded to bf16)."""
    if not on_tiles(q.dtype, q.shape[-1]):
        assert torch.equal(out, reference_attention(q, keys, values, visible, key_index))
        return
    exact, mag = softmax_attention(q, keys, values, visible, key_index)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2.0 ** -126))) - 7)  # a bf16 step at |exact|
    err = (out.double() - exact).abs()
    assert (err <= 0.5 * step + mag * 2.0 ** -8).all(), (err - 0.5 * step).max()


def causal_case(dtype, B=1, T=8, H=12, KV=2, D=128, committed=(150,), capacity=512, seed=0):
    """A pass of T new rows after `committed[b]` keys in each row b (their K/V already in the cache):
    q [B, T, H, D] (strided, as a split of qkv), the cache, visible [B, T, S]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * D + 8, generator=g).to(dtype)[..., :H * D].view(B, T, H, D)
    keys = (torch.randn(B, KV, capacity, D, generator=g) * 2).to(dtype)  # peaked softmaxes and flat ones
    values = torch.randn(B, KV, capacity, D, generator=g).to(dtype)
    S = max(committed) + T
    visible = torch.zeros(B, T, S, dtype=torch.bool)
    for b, n in enumerate(committed):
        for t in range(T):
            visible[b, t, :n + t + 1] = True
    return q, keys, values, visible


def attention(*args):
    return qgemm.ops().attention(*args)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H,KV,D", [(12, 2, 128), (4, 4, 64), (6, 3, 72), (2, 1, 20), (8, 2, 256), (20, 1, 96)])
def test_attention_is_the_reference_recipe_bit_for_bit(dtype, H, KV, D):
    """Grouped heads like the real target (12 query heads on 2 K/V heads of 128), one per K/V head, head
    sizes the vector code does not cover whole (72, 20), and on tiles: queries reloaded per key group (256),
    3 chunks of dims and 20 query heads a K/V head (two groups of 16 queries a row); keys within one block
    and across several."""
    q, keys, values, visible = causal_case(dtype, B=2, T=5, H=H, KV=KV, D=D, committed=(150, 30), capacity=256)
    check_recipe(attention(q, keys, values, visible, None), q, keys, values, visible)


def test_attention_is_close_to_softmax_attention_in_float64():
    q, keys, values, visible = causal_case(F32, B=1, T=3, committed=(300,))
    out = attention(q, keys, values, visible, None)
    k = keys[0, :, :303].double().repeat_interleave(6, 0)  # [H, S, D]
    v = values[0, :, :303].double().repeat_interleave(6, 0)
    scores = torch.einsum("thd,hsd->ths", q[0].double(), k) / 128 ** 0.5
    scores = scores.masked_fill(~visible[0, :, None, :], float("-inf"))
    ref = torch.einsum("ths,hsd->thd", torch.softmax(scores, -1), v)
    assert torch.allclose(out[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_query_has_the_same_bits_for_1_to_80_rows_chunks_batches_and_threads(dtype):
    """80 new rows after 200 keys (prefill at depth: several blocks, the diagonal inside them): the whole
    pass, its first 1, 4, 17 and 64 rows (decoding, verification), chunks of 1, 7, 16 and 33 rows (chunked
    prefill), the sequence as the last of three batch rows of other lengths, more (masked) key slots, and
    one thread vs two."""
    T = 80
    q, keys, values, visible = causal_case(dtype, T=T, committed=(200,), capacity=320)
    whole = attention(q, keys, values, visible, None)
    check_recipe(whole, q, keys, values, visible)
    for rows in (1, 4, 17, 64):
        assert torch.equal(attention(q[:, :rows], keys, values, visible[:, :rows, :200 + rows], None),
                           whole[:, :rows]), rows
    for chunk in (1, 7, 16, 33):
        parts = [attention(q[:, t:t + chunk], keys, values, visible[:, t:t + chunk, :200 + t + chunk], None)
                 for t in range(0, T, chunk)]
        assert torch.equal(torch.cat(parts, 1), whole), chunk
    wide = torch.cat([visible, torch.zeros(1, T, 40, dtype=torch.bool)], -1)
    assert torch.equal(attention(q, keys, values, wide, None), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention(q, keys, values, visible, None), whole)
        torch.set_num_threads(2)
        assert torch.equal(attention(q, keys, values, visible, None), whole)
    finally:
        torch.set_num_threads(threads)
    oq, ok, ov, ovis = causal_case(dtype, B=2, T=T, committed=(5, 130), capacity=320, seed=1)
    bq, bk, bv = torch.cat([oq, q]), torch.cat([ok, keys]), torch.cat([ov, values])
    bvis = torch.zeros(3, T, 280, dtype=torch.bool)
    bvis[:2, :, :ovis.shape[-1]], bvis[2] = ovis, visible[0]
    assert torch.equal(attention(bq, bk, bv, bvis, None)[2], whole[0])


@pytest.mark.parametrize("H,KV,D", [(8, 2, 256), (20, 1, 96)])
def test_other_head_shapes_give_a_row_the_same_bits_alone_and_in_a_pass(H, KV, D):
    """Each row of a 20-row pass after 70 keys (two blocks, the diagonal in the second) = that row alone, bf16:
    on tiles, queries reloaded for each group of keys (256 dims), and groups of 16 queries that split a row's
    20 query heads."""
    q, keys, values, visible = causal_case(torch.bfloat16, T=20, H=H, KV=KV, D=D, committed=(70,), capacity=128)
    whole = attention(q, keys, values, visible, None)
    check_recipe(whole, q, keys, values, visible)
    for t in (0, 7, 19):
        alone = attention(q[:, t:t + 1], keys, values, visible[:, t:t + 1, :71 + t], None)
        assert torch.equal(alone, whole[:, t:t + 1]), t


def test_decoding_at_depth_splits_keys_across_threads_with_the_same_bits():
    """One row over 1000 keys = the same row in a 40-row pass = the reference, for 1 to 4 threads (with more
    threads than K/V heads, each head's 16 blocks are split across threads, parts combined in order)."""
    q, keys, values, visible = causal_case(torch.bfloat16, T=40, committed=(960,), capacity=1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = attention(q[:, -1:], keys, values, visible[:, -1:], None)
        check_recipe(ref, q[:, -1:], keys, values, visible[:, -1:])
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(attention(q[:, -1:], keys, values, visible[:, -1:], None), ref), n
            assert torch.equal(attention(q, keys, values, visible, None)[:, -1:], ref), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tree_node_over_scattered_slots_has_the_bits_of_its_chain(dtype):
    """Tree verification: each node sees 130 committed keys, then its ancestors at scattered slots
    (key_index), in path order; its output is the reference's and that of the same keys laid out as a chain
    (what decoding the path token by token computes), though the tree's last block is gathered, not a run."""
    q, keys, values, _ = causal_case(dtype, T=3, committed=(130,), capacity=256)
    paths = [[140], [140, 150, 141], [145, 133]]  # node t's ancestors and itself, in path order
    S = 136
    key_index = torch.arange(S).expand(1, 3, S).clone()
    visible = torch.zeros(1, 3, S, dtype=torch.bool)
    visible[0, :, :130] = True
    for t, path in enumerate(paths):
        key_index[0, t, 130:130 + len(path)] = torch.tensor(path)
        visible[0, t, 130:130 + len(path)] = True
    tree = attention(q, keys, values, visible, key_index)
    check_recipe(tree, q, keys, values, visible, key_index)
    for t, path in enumerate(paths):
        chain_k, chain_v = keys.clone(), values.clone()
        chain_k[:, :, 130:130 + len(path)], chain_v[:, :, 130:130 + len(path)] = keys[:, :, path], values[:, :, path]
        chain = attention(q[:, t:t + 1], chain_k, chain_v, visible[:, t:t + 1], None)
        assert torch.equal(tree[:, t:t + 1], chain), t


def test_a_query_that_sees_no_key_gets_zeros():
    q, keys, values, visible = causal_case(F32, T=2, committed=(10,), capacity=64)
    visible[0, 0] = False
    out = attention(q, keys, values, visible, None)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.equal(out, reference_attention(q, keys, values, visible))


def paged(keys: torch.Tensor, page: int, pool: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys` [B, KV, capacity, D] laid out as pages of `page` slots at shuffled places of a pool of `pool`
    pages (the others random): (pool [pool, KV, page, D], table [B, capacity / page])."""
    B, KV, cap, D = keys.shape
    n = cap // page
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:B * n]
    table = order.view(B, n)
    out = torch.randn(pool, KV, page, D, generator=torch.Generator().manual_seed(seed + 1)).to(keys.dtype)
    out[table.flatten()] = keys.unflatten(2, (n, page)).transpose(1, 2).flatten(0, 1)
    return out, table


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page", [16, 64, 80])
def test_paged_keys_give_the_bits_of_contiguous_rows(dtype, page):
    """Keys and values in pages anywhere in a pool, read through each sequence's page table (paged K/V): every
    query's bits are those of the rows laid out whole, for a batch of chains (1 to 80 rows: blocks of 64 keys
    that span pages of 16, or pages of 80 that blocks cross), a tree's scattered slots across pages, and 1 or
    2 threads."""
    T = 80
    q, keys, values, visible = causal_case(dtype, B=2, T=T, committed=(200, 37), capacity=320)
    whole = attention(q, keys, values, visible, None)
    kp, table = paged(keys, page, pool=2 * 320 // page + 5)
    vp, _ = paged(values, page, pool=2 * 320 // page + 5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(attention(q, kp, vp, visible, None, table), whole), n
    finally:
        torch.set_num_threads(threads)
    for rows in (1, 4, 17):
        assert torch.equal(attention(q[:, :rows], kp, vp, visible[:, :rows], None, table), whole[:, :rows])
    key_index = torch.arange(visible.shape[-1]).expand(2, T, -1).clone()  # a tree: slots 241.. scattered
    key_index[:, :, 200:203] = torch.tensor([250, 215, 301])
    assert torch.equal(attention(q, kp, vp, visible, key_index, table), attention(q, keys, values, visible, key_index))


def test_page_tables_are_checked():
    q, keys, values, visible = causal_case(F32, T=2, committed=(10,), capacity=64)
    kp, table = paged(keys, 16, pool=6)
    vp, _ = paged(values, 16, pool=6)
    with pytest.raises(RuntimeError, match="a page outside the cache"):
        attention(q, kp, vp, visible, None, torch.full_like(table, 6))
    with pytest.raises(RuntimeError, match="more key slots than the cache holds"):
        attention(q, kp, vp, visible, None, table[:, :0])
    with pytest.raises(RuntimeError, match="pages"):
        attention(q, kp, vp, visible, None, table.int())


# ------------------------------------------------------------------------- an 8-bit K/V cache (q8_0)
def test_the_kernels_q8_0_rows_are_the_python_encoders_byte_for_byte():
    """`quantize_kv` (what the decoder-layer op writes) and `q8_encode` (what Python writes): the same bytes,
    for random rows at several scales, rows of zeros and rows whose largest value ties a rounding; decoding
    gives q * d, within half a step (d / 2) of the value."""
    from specdec.models.kv_cache import q8_decode, q8_encode

    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(2)[:, None, None, None]  # rows of 3 sizes
    x = torch.randn(6, 2, 40, 128, generator=g) * scales
    x[0, 0, :3] = 0
    x[1, 1, 0, :32] = torch.arange(32) * 0.5  # 15.5 / 127 and its multiples
    for dtype in (F32, torch.bfloat16):
        rows = q8_encode(x.to(dtype))
        assert rows.dtype == torch.int8 and rows.shape == (6, 2, 40, 136)
        assert torch.equal(qgemm.ops().quantize_kv(x.to(dtype)), rows)
        back = q8_decode(rows, F32)
        d = rows[..., 128:].contiguous().view(torch.float16).float().repeat_interleave(32, -1)
        assert (back - x.to(dtype).float()).abs().le(d / 2 * (1 + 2 ** -8)).all()
    assert q8_decode(q8_encode(torch.zeros(2, 64)), F32).eq(0).all()


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_q8_0_cache_reads_as_its_values_with_the_same_invariances(dtype):
    """Attention over a Q8_0 cache is attention over its values q * d: the portable recipe on them in fp32 (bit
    for bit), or on tiles those values in bf16 (bit for bit the kernel on a bf16 cache holding them); a row alone
    is that row in a pass, a tree node its chain, paged rows whole ones."""
    from specdec.models.kv_cache import q8_decode, q8_encode

    T = 20
    q, keys, values, visible = causal_case(dtype, B=2, T=T, committed=(150, 37), capacity=256)
    k8, v8 = q8_encode(keys), q8_encode(values)
    out = attention(q, k8, v8, visible, None)
    if on_tiles(dtype, 128):
        assert torch.equal(out, attention(q, q8_decode(k8, dtype), q8_decode(v8, dtype), visible, None))
    else:
        assert torch.equal(out, reference_attention(q, q8_decode(k8, F32), q8_decode(v8, F32), visible))
    for t in (0, 9, 19):
        alone = attention(q[:, t:t + 1], k8, v8, visible[:, t:t + 1, :150 + t + 1], None)
        assert torch.equal(alone[0], out[0, t:t + 1]), t
    kp, table = paged(k8, 16, pool=40)
    vp, _ = paged(v8, 16, pool=40)
    assert torch.equal(attention(q, kp, vp, visible, None, table), out)
    key_index = torch.arange(visible.shape[-1]).expand(2, T, -1).clone()  # a tree: scattered slots
    key_index[:, :, 150:153] = torch.tensor([160, 155, 201])
    tree = attention(q, kp, vp, visible, key_index, table)
    chain_k, chain_v = k8.clone(), v8.clone()
    chain_k[:, :, 150:153], chain_v[:, :, 150:153] = k8[:, :, [160, 155, 201]], v8[:, :, [160, 155, 201]]
    assert torch.equal(tree, attention(q, chain_k, chain_v, visible, None))


def test_a_q8_0_cache_with_a_head_size_not_of_32s_is_refused():
    q, keys, values, visible = causal_case(F32, T=2, committed=(10,), capacity=64, H=4, KV=2, D=40)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qgemm.ops().quantize_kv(keys)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attention(q, torch.zeros(1, 2, 64, 45, dtype=torch.int8), torch.zeros(1, 2, 64, 45, dtype=torch.int8),
                  visible, None)


# ------------------------------------------------------------------------- long contexts, end to end
@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny 2-layer GGUF on the block kernels (bf16 activations, as the real target runs), with a
    context of 16k + and its prompts of 8k and 16k tokens that repeat (so that drafts get accepted)."""
    from specdec.models.loading import load_quantized
    from test_tokenizer import write_tiny_gguf

    path = tmp_path_factory.mktemp("long") / "tiny.gguf"
    write_tiny_gguf(path, context_length=16384 + 256)
    _, model, tokenizer = load_quantized(path, "gguf", torch.bfloat16)
    return model, tokenizer


def greedy_run(engine, prompt: list[int], params):
    """Run one request on `engine` to its end: its final output."""
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    return final


@pytest.mark.parametrize("length", [8192, 16384], ids=["8k", "16k"])
def test_greedy_after_a_long_prompt_is_the_same_for_plain_and_every_drafter(long_model, length):
    """Plain decoding vs a draft model (the model itself), n-gram, suffix chains and suffix trees after a
    prompt of 8k tokens fed in chunks of 512: the same greedy tokens, bit for bit (every pass is a different
    shape: 1 row, K + 1 rows, tree rows, 512-row chunks). At 16k, the draft model and suffix trees only (the
    two pass shapes, chain and tree; n-gram and suffix chains verify chains as the draft model does), to
    keep the test to a few minutes."""
    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.speculative.draft_model import DraftModelProposer
    from specdec.speculative.proposers import NgramProposer, SuffixProposer
    from specdec.speculative.suffix import SuffixCache

    model, tokenizer = long_model
    g = torch.Generator().manual_seed(length)
    motif = torch.randint(3, 60, (300,), generator=g).tolist()
    prompt = (motif * (length // 300 + 1))[:length]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    max_len = length + 64

    def generate(proposer=None, k: int = 0):
        return greedy_run(Engine(model, tokenizer, proposer=proposer, num_speculative_tokens=k, max_model_len=max_len),
                          prompt, params)

    plain = generate().token_ids
    drafters = {
        "draft model": (DraftModelProposer(model, 1, max_len, window=max_len), 3),
        "ngram": (NgramProposer(max_n=3), 4),
        "suffix": (SuffixProposer(SuffixCache()), 5),
        "suffix tree": (SuffixProposer(SuffixCache(), tree=True), 5),
    }
    if length > 8192:
        drafters = {name: drafters[name] for name in ("draft model", "suffix tree")}
    for name, (proposer, k) in drafters.items():
        out = generate(proposer, k)
        assert out.token_ids == plain, name
        assert out.metrics.num_drafts > 0, name


@pytest.fixture(scope="module")
def model_of_32s(tmp_path_factory):
    """The tiny GGUF with 2 query heads on 1 K/V head of 32 (Q8_0 rows need a multiple of 32), a 2.3k context."""
    from specdec.models.loading import load_quantized
    from test_tokenizer import write_tiny_gguf

    path = tmp_path_factory.mktemp("q8") / "tiny32.gguf"
    write_tiny_gguf(path, context_length=2304, heads=2, kv_heads=1)
    _, model, tokenizer = load_quantized(path, "gguf", torch.bfloat16)
    return model, tokenizer


def test_greedy_on_a_q8_0_cache_is_the_same_for_plain_and_every_drafter(model_of_32s):
    """`--kv-cache-dtype q8_0` after a 2k-token prompt: plain decoding, a draft model (the model itself, its cache
    in q8_0 too), suffix chains and trees give the same greedy tokens, bit for bit (each token's row is encoded
    alone, by the decoder-layer op in every pass shape), and the cache holds int8 rows."""
    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.speculative.draft_model import DraftModelProposer
    from specdec.speculative.proposers import SuffixProposer
    from specdec.speculative.suffix import SuffixCache

    model, tokenizer = model_of_32s
    motif = torch.randint(3, 60, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt = (motif * 7)[:2048]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    model.kv_format = "q8_0"
    try:
        def generate(proposer=None, k: int = 0):
            engine = Engine(model, tokenizer, proposer=proposer, num_speculative_tokens=k, max_model_len=2112)
            assert engine.cache.keys[0].dtype == torch.int8
            return greedy_run(engine, prompt, params)

        plain = generate().token_ids
        for name, (proposer, k) in {"draft model": (DraftModelProposer(model, 1, 2112, window=2112), 3),
                                    "suffix": (SuffixProposer(SuffixCache()), 5),
                                    "suffix tree": (SuffixProposer(SuffixCache(), tree=True), 5)}.items():
            out = generate(proposer, k)
            assert out.token_ids == plain, name
            assert out.metrics.num_drafts > 0, name
    finally:
        model.kv_format = "auto"
