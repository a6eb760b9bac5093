"""Every decoder family against transformers' implementation of it, on tiny random-weight models built here
(`specdec.testing.tiny_arch`): Qwen3, Gemma 3 (sliding layers with their own rope, sandwich norms, scaled
embeddings, tanh-GELU), Phi-3 (fused checkpoints, sliding window), Qwen3-MoE and Mixtral (routed experts), and
Llama as the control.

- the float path, read from the Hugging Face folder and from an F32 GGUF laid out as llama.cpp writes it: logits
  within fp32 tolerance of transformers', greedy output equal to transformers' for 32 tokens;
- the block kernels (a Q8_0 GGUF): a row's logits do not depend on the rows computed with it, and speculative
  greedy output equals plain decoding token for token (draft model, n-grams; K 1-5; batches; prefix-cache hits).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from specdec.bench.compare import decode as run
from specdec.config import ModelConfig, SamplingParams
from specdec.engine import Engine
from specdec.models.loading import hf_config, load_checkpoint, load_quantized, split_fused
from specdec.models.tokenizer import Tokenizer
from specdec.speculative.draft_model import DraftModelProposer
from specdec.speculative.proposers import NgramProposer
from specdec.testing.tiny_arch import FAMILIES, reference_model, write_gguf
from test_tokenizer import TOKENS, _add_tokenizer

VOCAB = len(TOKENS)
NEW_FAMILIES = ["qwen3", "gemma3", "phi3", "qwen3_moe", "mixtral"]
MAX_LEN = 256


def prompt_ids(seed: int, n: int = 24) -> list[int]:
    """Random ids of the tiny vocabulary, a repeated stretch in the middle (n-gram drafts find something)."""
    ids = torch.randint(0, VOCAB - 8, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids[: n // 2] + ids[2:8] + ids[n // 2:]


@pytest.fixture(scope="module", params=["llama", *NEW_FAMILIES])
def family(request, tmp_path_factory):
    """(name, transformers model, HF folder, F32 GGUF, Q8_0 GGUF, tokenizer)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = reference_model(name, VOCAB)
    model.save_pretrained(folder / "hf")
    write_gguf(folder / "hf", folder / "f32.gguf", _add_tokenizer)
    write_gguf(folder / "hf", folder / "q8.gguf", _add_tokenizer, GGMLQuantizationType.Q8_0)
    tokenizer = Tokenizer.from_gguf(__import__("gguf").GGUFReader(folder / "f32.gguf"))
    tokenizer.save(folder / "hf")
    return name, model, folder, tokenizer


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, MAX_LEN)
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


@pytest.mark.parametrize("source", ["hf", "f32.gguf"])
def test_float_logits_match_transformers(family, source):
    name, reference, folder, _ = family
    _, model, _ = _float_model(folder / source)
    for seed in range(3):
        ids = prompt_ids(seed, 40)  # past the sliding windows (8, 12) of Gemma 3 and Phi-3
        expected, got = reference_logits(reference, ids), our_logits(model, ids)
        assert (got - expected).abs().max().item() < 2e-4 * max(1.0, expected.abs().max().item()), name


def _float_model(path):
    from specdec.models.llama import Transformer

    config, weights, tokenizer = load_checkpoint(path, torch.float32)
    return config, Transformer.from_state_dict(config, weights), tokenizer


def test_greedy_output_matches_transformers(family):
    name, reference, folder, tokenizer = family
    _, model, _ = _float_model(folder / "hf")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for seed in range(2):
        ids = prompt_ids(seed)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                     eos_token_id=None, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        got = run(Engine(model, tokenizer, None, num_speculative_tokens=0,
                         max_model_len=MAX_LEN), ids, params).token_ids
        assert got == expected, name


def test_the_config_reads_back_what_it_writes(family):
    name, reference, folder, _ = family
    config = hf_config(folder / "hf")
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.architecture == FAMILIES[name][1]
    if name in ("gemma3", "phi3"):
        assert config.sliding_window and "sliding_attention" in config.layer_types
    if name in ("qwen3_moe", "mixtral"):
        assert config.num_experts and all(config.is_moe(i) for i in range(config.num_hidden_layers))


def test_gguf_and_hf_folders_give_the_same_config(family):
    name, _, folder, _ = family
    from_gguf, from_hf = load_checkpoint(folder / "f32.gguf", torch.float32)[0], hf_config(folder / "hf")
    shape = ("architecture", "hidden_size", "num_hidden_layers", "head_dim", "layer_types", "sliding_window",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "hidden_act",
             "tie_word_embeddings", "rope_theta", "query_pre_attn_scalar")
    assert {k: getattr(from_gguf, k) for k in shape} == {k: getattr(from_hf, k) for k in shape}, name


@pytest.fixture(scope="module")
def blocks(family):
    """The Q8_0 GGUF on the block kernels (activations fp32), and its plain greedy outputs of 3 prompts."""
    name, _, folder, _ = family
    config, model, tokenizer = load_quantized(folder / "q8.gguf", "gguf", torch.float32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [prompt_ids(seed, 20 + 8 * seed) for seed in range(3)]
    plain = [run(Engine(model, tokenizer, None, num_speculative_tokens=0,
                        max_model_len=MAX_LEN), ids, params).token_ids for ids in prompts]
    return model, tokenizer, prompts, plain, params


def test_block_rows_do_not_depend_on_the_rows_computed_with_them(blocks):
    """Feeding 30 tokens in passes of 1, 2, 3 or 5 rows gives every row the same logits, bit for bit (for a
    mixture of experts: a pass routes each row to its own experts, whatever the other rows chose)."""
    model = blocks[0]
    ids = prompt_ids(7, 40)
    logits = {}
    for width in (1, 2, 3, 5):
        cache = model.new_cache(1, MAX_LEN)
        model(torch.tensor([ids[:10]]), torch.arange(10)[None], cache)
        cache.advance(0, 10)
        rows = []
        for s in range(10, len(ids), width):
            chunk = ids[s:s + width]
            rows.append(model(torch.tensor([chunk]), torch.arange(s, s + len(chunk))[None], cache)[0])
            cache.advance(0, len(chunk))
        logits[width] = torch.cat(rows)
    for width in (2, 3, 5):
        assert torch.equal(logits[width], logits[1]), f"{width} rows at once round differently from 1"


def test_the_fused_layer_op_computes_the_bits_of_the_layers_modules(blocks):
    """Each dense layer as one CPU op (`decoder_layer`: q/k norms, sandwich norms, tanh-GELU where the family has
    them) against the same layer run module by module, for a prompt and then 3 more tokens at once."""
    model = blocks[0]
    fused = [layer for layer in model.model.layers if layer.fused_args is not None]
    assert len(fused) == (0 if model.config.arch.moe else model.config.num_hidden_layers)
    ids = prompt_ids(5, 24)  # 30 ids

    def logits():
        cache = model.new_cache(1, MAX_LEN)
        first = model(torch.tensor([ids[:27]]), torch.arange(27)[None], cache)[0]
        cache.advance(0, 27)
        return torch.cat([first, model(torch.tensor([ids[27:]]), torch.arange(27, 30)[None], cache)[0]])

    kept = [layer.fused_args for layer in fused]
    as_one_op = logits()
    for layer in fused:
        layer.fused_args = None
    try:
        module_by_module = logits()
    finally:
        for layer, args in zip(fused, kept):
            layer.fused_args = args
    assert torch.equal(as_one_op, module_by_module)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_speculative_greedy_equals_plain_on_the_block_kernels(blocks, k):
    """The model drafting for itself (every draft accepted: bonus tokens, K-row passes) and n-grams (mostly
    rejected) give plain decoding's tokens."""
    model, tokenizer, prompts, plain, params = blocks
    for ids, expected in zip(prompts, plain):
        engine = Engine(model, tokenizer, DraftModelProposer(model, 1, MAX_LEN), num_speculative_tokens=k,
                        max_model_len=MAX_LEN)
        out = run(engine, ids, params)
        assert out.token_ids == expected and out.metrics.num_drafts > 0
        assert run(Engine(model, tokenizer, NgramProposer(), num_speculative_tokens=k,
                          max_model_len=MAX_LEN), ids, params).token_ids == expected


def test_a_batch_and_prefix_hits_give_plain_tokens(blocks):
    """Three requests decoded together (one pass reads all their rows), then again with their prompts'
    blocks in the prefix cache, each speculating K=4: each gets its plain tokens."""
    model, tokenizer, prompts, plain, params = blocks
    engine = Engine(model, tokenizer, DraftModelProposer(model, 3, MAX_LEN), num_speculative_tokens=4,
                    max_model_len=MAX_LEN, max_batch_size=3, prefix_cache_blocks=64, prefix_block_size=16)
    for attempt in range(2):
        for i, ids in enumerate(prompts):
            engine.add_request(f"{attempt}-{i}", ids, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert [done[f"{attempt}-{i}"].token_ids for i in range(3)] == plain
    assert sum(done[f"1-{i}"].metrics.cached_tokens for i in range(3)) > 0


def test_phi3_checkpoints_split_into_the_float_layers_matrices():
    config = ModelConfig("Phi3ForCausalLM", 16, 8, 6, 1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    qkv, gate_up = torch.arange(16 * 8.0).view(16, 8), torch.arange(12 * 8.0).view(12, 8)
    weights = split_fused(config, {"model.layers.0.self_attn.qkv_proj.weight": qkv,
                                   "model.layers.0.mlp.gate_up_proj.weight": gate_up})
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], qkv[:8])
    assert torch.equal(weights["model.layers.0.self_attn.v_proj.weight"], qkv[12:])
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], gate_up[6:])


def test_gemma3_query_scale_other_than_head_dim_matches_transformers(tmp_path):
    reference = reference_model("gemma3", VOCAB, query_pre_attn_scalar=24)
    reference.save_pretrained(tmp_path)
    config = hf_config(tmp_path)
    from specdec.models.llama import Transformer

    from specdec.models.loading import load_safetensors
    model = Transformer.from_state_dict(config, load_safetensors(tmp_path, config, torch.float32, "cpu"))
    ids = prompt_ids(3, 30)
    expected = reference_logits(reference, ids)
    assert (our_logits(model, ids) - expected).abs().max().item() < 2e-4 * expected.abs().max().item()


def test_unsupported_families_and_settings_are_clear_errors():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        ModelConfig.from_hf({**base, "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_hf({**base, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        ModelConfig.from_hf({**base, "hidden_act": "relu"})
