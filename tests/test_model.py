"""Our decoder against transformers' implementation (the reference), and the KV cache's rollback."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf_model, tiny_model


def full_forward(model, tokens):
    cache = model.new_cache(tokens.shape[0], 64)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, cache)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", {}),
        ("llama", {}),
        ("mistral", {}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ],
)
def test_logits_match_transformers(arch, overrides):
    hf = tiny_hf_model(arch, **overrides)
    ours = ours_from_hf(hf)
    tokens = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    expected = hf(tokens).logits
    got = full_forward(ours, tokens)
    assert (got - expected).abs().max().item() < 1e-4


def test_prefill_then_decode_equals_full_forward():
    hf = tiny_hf_model("qwen2")
    ours = ours_from_hf(hf)
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    expected = hf(tokens).logits[0]
    cache = ours.new_cache(1, 64)
    logits = [ours(tokens[:, :8], torch.arange(8)[None], cache)[0]]
    cache.advance(0, 8)
    for t in range(8, 20):
        logits.append(ours(tokens[:, t:t + 1], torch.tensor([[t]]), cache)[0])
        cache.advance(0, 1)
    got = torch.cat(logits)
    assert (got - expected).abs().max().item() < 1e-4


def test_truncate_and_redecode_gives_the_logits_of_never_having_gone_further():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 97, (1, 10), generator=gen)
    wrong = torch.randint(0, 97, (1, 5), generator=gen)
    nxt = torch.randint(0, 97, (1, 3), generator=gen)

    clean = model.new_cache(1, 64)
    model(prefix, torch.arange(10)[None], clean)
    clean.advance(0, 10)
    expected = model(nxt, torch.arange(10, 13)[None], clean)

    dirty = model.new_cache(1, 64)
    model(prefix, torch.arange(10)[None], dirty)
    dirty.advance(0, 10)
    model(wrong, torch.arange(10, 15)[None], dirty)
    dirty.advance(0, 5)
    dirty.truncate(0, 10)
    got = model(nxt, torch.arange(10, 13)[None], dirty)
    assert torch.equal(got, expected)


def test_tree_mask_positions_and_commit_match_decoding_each_path_alone():
    """Nodes of a tree verified in one pass get the logits of their path decoded alone; commit keeps a path."""
    model = tiny_model("qwen2")
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 97, (1, 6), generator=gen)
    # tree: root a; children b, c of a; child d of c.   nodes: 0=a 1=b 2=c 3=d
    nodes = torch.randint(0, 97, (1, 4), generator=gen)
    parents = [-1, 0, 0, 2]
    depth = [0, 1, 1, 2]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    cache = model.new_cache(1, 64)
    model(prefix, torch.arange(6)[None], cache)
    cache.advance(0, 6)
    tree_logits = model(nodes, (6 + torch.tensor(depth))[None], cache, mask=mask[None])[0]

    for leaf, path in [(1, [0, 1]), (3, [0, 2, 3])]:
        alone = model.new_cache(1, 64)
        seq = torch.cat([prefix, nodes[:, path]], dim=1)
        logits = model(seq, torch.arange(seq.shape[1])[None], alone)[0, 6:]
        assert torch.allclose(tree_logits[path], logits, atol=1e-5)

    # commit the path a-c-d, then decode one more token: same as having decoded that path alone
    cache.commit(0, [0, 2, 3])
    assert cache.lengths == [9]
    nxt = torch.tensor([[5]])
    got = model(nxt, torch.tensor([[9]]), cache)
    alone = model.new_cache(1, 64)
    seq = torch.cat([prefix, nodes[:, [0, 2, 3]], nxt], dim=1)
    expected = model(seq, torch.arange(10)[None], alone)[:, -1:]
    assert torch.allclose(got, expected, atol=1e-5)


def test_tree_nodes_get_the_bits_of_their_path_decoded_one_token_at_a_time():
    """bf16, exact: a tree pass gives each node the logits that plain decoding of its path gives, bit for
    bit, also for nodes off the first branch and across a 64-key block boundary (what makes greedy tree
    verification exact)."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]  # root's children 1, 2; 5 under 2; 6 under 5; 7 under 3
    for prefix_len in (5, 60):
        prefix = torch.randint(0, 97, (1, prefix_len), generator=gen)
        nodes = torch.randint(0, 97, (1, len(parents)), generator=gen)
        paths = []
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.insert(0, j)
                j = parents[j]
            paths.append(path)
        mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for i, path in enumerate(paths):
            mask[i, path] = True
        depth = torch.tensor([len(p) - 1 for p in paths])
        cache = model.new_cache(1, 128)
        model(prefix, torch.arange(prefix_len)[None], cache)
        cache.advance(0, prefix_len)
        tree_logits = model(nodes, (prefix_len + depth)[None], cache, mask=mask[None])[0]
        for i, path in enumerate(paths):
            alone = model.new_cache(1, 128)
            model(prefix, torch.arange(prefix_len)[None], alone)
            alone.advance(0, prefix_len)
            for d, node in enumerate(path):  # plain decoding: one token per pass
                logits = model(nodes[:, [node]], torch.tensor([[prefix_len + d]]), alone)[0, 0]
                alone.advance(0, 1)
            assert torch.equal(tree_logits[i], logits), (prefix_len, i)


def test_batched_rows_of_different_lengths_match_single_rows():
    model = tiny_model("llama", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, 97, (1, 9), generator=gen)
    b = torch.randint(0, 97, (1, 4), generator=gen)
    step = torch.randint(0, 97, (2, 3), generator=gen)
    batch = model.new_cache(2, 64)
    for row, seq in enumerate([a, b]):  # prefill each row alone, as the engine does
        single = model.new_cache(1, 64)
        model(seq, torch.arange(seq.shape[1])[None], single)
        batch.reserve(row, seq.shape[1])  # its pages in the batch's pool, then the row's K/V copied in
        for layer in range(len(single.keys)):
            batch.keys[layer][batch.pages[row]] = single.keys[layer][single.pages[0]]
            batch.values[layer][batch.pages[row]] = single.values[layer][single.pages[0]]
        batch.lengths[row] = seq.shape[1]
    positions = torch.tensor([[9, 10, 11], [4, 5, 6]])
    got = model(step, positions, batch)
    for row, seq in enumerate([a, b]):
        single = model.new_cache(1, 64)
        model(seq, torch.arange(seq.shape[1])[None], single)
        single.advance(0, seq.shape[1])
        expected = model(step[row:row + 1], positions[row:row + 1], single)
        assert torch.equal(got[row], expected[0])


def test_rows_do_not_depend_on_how_many_are_computed_together():
    """The property exact speculation rests on, across several 64-key attention blocks: 90 tokens fed in
    passes of 1, 2, 3, 6 or 9 rows give every row the same logits, bit for bit, in bf16. (fp32 is not
    covered: MKL's sgemm rounds a row differently with the number of rows on this CPU.)"""
    model = tiny_model("qwen2", dtype=torch.bfloat16, num_hidden_layers=1)
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(6))
    logits = {}
    for width in (1, 2, 3, 6, 9):
        cache = model.new_cache(1, 128)
        model(ids[:, :10], torch.arange(10)[None], cache)
        cache.advance(0, 10)
        rows = []
        for s in range(10, 100, width):
            chunk = ids[:, s:s + width]
            rows.append(model(chunk, torch.arange(s, s + chunk.shape[1])[None], cache)[0])
            cache.advance(0, chunk.shape[1])
        logits[width] = torch.cat(rows)
    for width in (2, 3, 6, 9):
        assert torch.equal(logits[width], logits[1]), width


def test_a_query_attends_as_decoding_it_alone_whatever_the_pass_at_long_contexts():
    """Attention of 6, 8, 13 or 40 queries in one pass, in two rows of 3000 and 600 keys: each query gets the
    bits of decoding it alone (one query, over its own key blocks). Regression: bf16 matmuls over several
    queries, or over more (masked) key blocks, took other kernels from ~600 keys on, so a verified token's K/V
    differed from its prefilled K/V, which a prefix-cache hit then reused (a greedy token flipped)."""
    from specdec.config import ModelConfig
    from specdec.models.llama import KEY_BLOCK, Attention

    config = ModelConfig("Qwen2ForCausalLM", 97, 768, 128, 1, num_attention_heads=6, num_key_value_heads=1,
                         head_dim=128)  # the 1.5B's kv-head groups: 6 queries of 128 per key head
    attn = Attention(config, 0)
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 1, 3072, 128, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(2, 40, 6, 128, generator=gen).bfloat16()
    lengths = [3000, 600]
    blocks = lambda n: -(-n // KEY_BLOCK) * KEY_BLOCK  # noqa: E731

    def visible(length: int, T: int, S: int) -> torch.Tensor:  # [T, S]: query t sees slots <= length + t
        return torch.arange(S)[None, :] <= length + torch.arange(T)[:, None]

    for T in (6, 8, 13, 40):
        S = blocks(max(lengths) + T)
        mask = torch.stack([visible(n, T, S) for n in lengths])
        out = attn._exact_attention(q[:, :T], keys[:, :, :S], values[:, :, :S], mask)
        for b, n in enumerate(lengths):
            for t in range(T):
                s = blocks(n + t + 1)
                alone = attn._exact_attention(q[b:b + 1, t:t + 1], keys[b:b + 1, :, :s], values[b:b + 1, :, :s],
                                              visible(n + t, 1, s)[None])
                assert torch.equal(out[b, t], alone[0, 0]), (T, b, t)


def test_meta_skeleton_patches_nothing_process_wide():
    """Modules built inside it are on the meta device, their initializers skipped for that block only:
    torch.nn.init is the same before, inside and after, and a module built outside is initialized."""
    from torch import nn

    from specdec.models.llama import meta_skeleton

    init = nn.init.kaiming_uniform_
    with meta_skeleton():
        assert nn.init.kaiming_uniform_ is init
        skeleton = nn.Linear(8, 8)
    assert skeleton.weight.is_meta and nn.init.kaiming_uniform_ is init
    assert nn.Linear(8, 8).weight.abs().sum() > 0
