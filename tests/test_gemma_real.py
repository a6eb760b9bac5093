"""Gemma 3 270M, the real GGUF (Q4_K_M, pulled by scripts/setup.sh): our float path greedy-decodes what
transformers decodes from the same file, on 10 prompts it was never tuned on, and on the block kernels speculative
decoding (n-grams, suffix trees) gives plain decoding's tokens. Skipped unless `specdec models pull gemma-3-270m`
has run."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from specdec.bench.compare import decode as run
from specdec.config import SamplingParams
from specdec.data import DATA_DIR
from specdec.engine import Engine
from specdec.models import store
from specdec.speculative.proposers import NgramProposer, SuffixProposer
from specdec.speculative.suffix import SuffixCache

GEMMA = "gemma-3-270m"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def path():
    if not store.is_pulled(GEMMA):
        pytest.skip(f"{GEMMA} is not pulled (specdec models pull {GEMMA})")
    return store.gguf_path(store.known_model(GEMMA))


def held_out_prompts(tokenizer, n: int = 10) -> list[list[int]]:
    """HumanEval's problems 100-109, cut to 48 tokens (with BOS, as the model expects)."""
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        problems = [json.loads(line) for line in f][100:100 + n]
    return [tokenizer.encode(p["prompt"], add_special_tokens=True)[:48] for p in problems]


def test_float_path_greedy_matches_transformers(path):
    from transformers import AutoModelForCausalLM

    from specdec.models.llama import Transformer
    from specdec.models.loading import load_checkpoint

    config, weights, tokenizer = load_checkpoint(path, torch.float32)
    ours = Transformer.from_state_dict(config, weights)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for ids in held_out_prompts(tokenizer):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        got = run(Engine(ours, tokenizer, None, num_speculative_tokens=0, max_model_len=256), ids, params).token_ids
        assert got == out[0, len(ids):].tolist()


def test_speculative_greedy_equals_plain_on_the_block_kernels(path):
    from specdec.models.loading import load_quantized

    _, model, tokenizer = load_quantized(path, "gguf", torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for ids in held_out_prompts(tokenizer, 3):
        plain = run(Engine(model, tokenizer, None, num_speculative_tokens=0, max_model_len=256), ids, params).token_ids
        for proposer in (NgramProposer(), SuffixProposer(SuffixCache()), SuffixProposer(SuffixCache(), tree=True)):
            out = run(Engine(model, tokenizer, proposer, num_speculative_tokens=5, max_model_len=256), ids, params)
            assert out.token_ids == plain, type(proposer).__name__


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_shipped_medusa_heads_greedy_equals_plain(path, tree):
    """The Medusa heads shipped for Gemma 3 270M (`data/heads/gemma-3-270m-medusa`), K = 3, chain and tree."""
    from specdec.heads.files import load_heads, resolve_heads, shipped_heads
    from specdec.models.loading import load_quantized
    from specdec.speculative.head_proposers import MedusaProposer, default_tree

    _, model, tokenizer = load_quantized(path, "gguf", torch.bfloat16)
    assert shipped_heads(model) == resolve_heads("gemma-3-270m-medusa")  # found by the target's fingerprint
    head = load_heads(resolve_heads("gemma-3-270m-medusa"), model, "medusa")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    accepted = 0
    for ids in held_out_prompts(tokenizer, 2):
        plain = run(Engine(model, tokenizer, None, num_speculative_tokens=0, max_model_len=256), ids, params).token_ids
        proposer = MedusaProposer(head, model.config.vocab_size, default_tree(3) if tree else None, max_depth=3)
        out = run(Engine(model, tokenizer, proposer, num_speculative_tokens=3, max_model_len=256), ids, params)
        assert out.token_ids == plain
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0
