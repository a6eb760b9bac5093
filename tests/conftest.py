"""Shared fixtures: tiny random models (Llama and Qwen2 shapes) built with transformers as the reference."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from specdec.config import ModelConfig
from specdec.models.llama import Transformer

# `specdec serve` keeps its prefix cache on disk (under $SPECDEC_HOME/kv by default): the servers the tests start
# write theirs in a folder of this test process's own, so that no run reads what another one left
if "SPECDEC_PREFIX_CACHE_DIR" not in os.environ:
    _kv = tempfile.mkdtemp(prefix="specdec-test-kv-")
    os.environ["SPECDEC_PREFIX_CACHE_DIR"] = _kv
    atexit.register(shutil.rmtree, _kv, ignore_errors=True)
if "SPECDEC_RESPONSES_DB" not in os.environ:  # (and the stored responses of /v1/responses, likewise)
    _db = tempfile.mkdtemp(prefix="specdec-test-responses-")
    os.environ["SPECDEC_RESPONSES_DB"] = os.path.join(_db, "responses.sqlite3")
    atexit.register(shutil.rmtree, _db, ignore_errors=True)

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_hf_model(arch: str = "qwen2", seed: int = 0, **overrides):
    """A random transformers model (the reference implementation), fp32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**{"tie_word_embeddings": True, **kw})
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**{"tie_word_embeddings": False, **kw})
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{"tie_word_embeddings": False, "sliding_window": None, **kw})
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "eager"
    # random biases and norm weights, so that every parameter is exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    return model.eval()


def ours_from_hf(hf_model, dtype: torch.dtype = torch.float32) -> Transformer:
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    model = Transformer(config)
    model.load_state_dict(hf_model.state_dict(), strict=False)
    return model.to(dtype).eval()


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """Our model with random weights, without transformers."""
    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    n_heads = kw["num_attention_heads"]
    config = ModelConfig(
        architecture={"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch],
        head_dim=kw["hidden_size"] // n_heads,
        tie_word_embeddings=arch == "qwen2",
        attention_bias=arch == "qwen2",
        eos_token_ids=(kw["vocab_size"] - 1,),
        **kw,
    )
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
    return model.to(dtype).eval()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield
