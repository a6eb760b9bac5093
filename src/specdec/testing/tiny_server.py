"""Engine replicas of a tiny random model for the tests of `specdec serve --replicas` (a `ReplicaSpec` loader).

Every replica builds the same model (seeded): a 2-layer Qwen2-shaped transformer over `ByteTokenizer`'s 257
tokens, with a prefix cache, so that what replicas answer is comparable and prefix-cache hits are real.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.models.llama import Transformer
from specdec.testing.byte_tokenizer import EOS, ByteTokenizer

MAX_MODEL_LEN = 1024
NAME = "tiny"


def tiny_transformer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=EOS + 1, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=MAX_MODEL_LEN, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         attention_bias=True, eos_token_ids=(EOS,))
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1 if p.dim() == 1 else 0.5 / p.shape[-1] ** 0.5)
    return model.eval()


def load_engine(args: argparse.Namespace) -> tuple[Engine, list[str], dict[str, Any]]:
    engine = Engine(tiny_transformer(), ByteTokenizer(), max_model_len=MAX_MODEL_LEN, max_batch_size=args.max_num_seqs,
                    prefix_cache_blocks=256 if args.enable_prefix_caching else 0)
    return engine, [NAME], {"api_key": args.api_key, "public_metrics": args.public_metrics}


def load_tokenizer(args: argparse.Namespace) -> ByteTokenizer:
    return ByteTokenizer()
