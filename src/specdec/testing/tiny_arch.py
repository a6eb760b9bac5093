"""Tiny random-weight models of each decoder family, built by transformers (the reference implementation) and
written as a Hugging Face folder and as a GGUF laid out as llama.cpp's converter lays it out (its tensor names,
its q/k row order for Llama-style rope, Gemma's norms stored plus one, experts merged into 3-D tensors).

Used by tests/test_architectures.py and the mixture-of-experts benchmark. Example:

    model = reference_model("qwen3_moe", vocab=264)
    model.save_pretrained(tmp / "hf")
    write_gguf(tmp / "hf", tmp / "tiny.gguf", add_tokenizer, qtype=GGMLQuantizationType.Q8_0)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors import safe_open

SLIDING, FULL = "sliding_attention", "full_attention"

# family -> (transformers config and model class names, what the tiny model sets beyond the common shape)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "layer_types": [SLIDING, FULL, SLIDING],
        "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 12, "pad_token_id": 0, "bos_token_id": None,
                                               "eos_token_id": None}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "bos_token_id": None, "eos_token_id": None}),
}
GGUF_NAMES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
              "mixtral": "llama"}


def reference_model(family: str, vocab: int, seed: int = 0, layers: int = 3, **overrides) -> torch.nn.Module:
    """A transformers model of `family` (fp32, eval): hidden 64, 4 heads, 2 KV heads. Its weights are drawn
    wider than transformers' init (std 0.1, norms around 1) so that greedy choices are not near-ties."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    settings = {**shape, **extra, **overrides}
    if "layer_types" in settings:
        settings["layer_types"] = (settings["layer_types"] * layers)[:layers]
    config = getattr(transformers, config_name)(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's are stored less one
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.0 if family == "gemma3" else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for Llama-style rope (what specdec's loader undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, path: Path, add_tokenizer: Callable[[GGUFWriter], None],
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
    """The Hugging Face folder of a model (`model.save_pretrained(folder)`) as llama.cpp's converter would write
    it, from the checkpoint's own tensors: matrices in `qtype` (F32 or Q8_0; vectors stay F32), the tokenizer
    metadata `add_tokenizer` writes."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    family = next(f for f, (_, name, _) in FAMILIES.items() if name == cfg["architectures"][0])
    arch = GGUF_NAMES[family]
    with safe_open(str(Path(folder) / "model.safetensors"), "np") as f:
        sd = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
    writer = GGUFWriter(str(path), arch)
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    meta = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": hidden, "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        meta.update({"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"]})
        if family == "qwen3_moe":
            meta["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if cfg.get("sliding_window") and family != "qwen3":
        meta["attention.sliding_window"] = cfg["sliding_window"]
    if family == "gemma3":  # (llama.cpp fixes the pattern at 6; the tiny model alternates)
        meta["attention.sliding_window_pattern"] = 2
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    params = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    writer.add_float32(f"{arch}.rope.freq_base", params.get(FULL, params)["rope_theta"])
    add_tokenizer(writer)

    def put(name: str, w: np.ndarray) -> None:
        if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            writer.add_tensor(name, quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), raw_dtype=qtype)

    offset = 1.0 if family == "gemma3" else 0.0
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"] + offset)
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"])
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    if family == "gemma3":
        norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in norms.items():
            put(f"{b}{gg}.weight", sd[f"{p}{hf}.weight"] + offset)
        for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if f"{p}self_attn.{hf}.weight" in sd:
                put(f"{b}{gg}.weight", sd[f"{p}self_attn.{hf}.weight"] + offset)
        if family == "phi3":
            put(f"{b}attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
            put(f"{b}ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])  # gate and up: 2 * intermediate rows
            put(f"{b}ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        else:
            for x, n in (("q", heads), ("k", kv_heads), ("v", None)):
                w = sd[f"{p}self_attn.{x}_proj.weight"]
                put(f"{b}attn_{x}.weight", rope_permute(w, n) if arch == "llama" and n else w)
        put(f"{b}attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if experts:  # the router, and each matrix of all experts as one [experts, rows, cols]
            moe, names = (p + "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}) if family == "mixtral" \
                else (p + "mlp.", {x: f"{x}_proj" for x in ("gate", "up", "down")})
            put(f"{b}ffn_gate_inp.weight", sd[moe + "gate.weight"])
            for x, name in names.items():
                put(f"{b}ffn_{x}_exps.weight", np.stack([sd[f"{moe}experts.{e}.{name}.weight"] for e in range(experts)]))
        elif family != "phi3":
            for x in ("gate", "up", "down"):
                put(f"{b}ffn_{x}.weight", sd[f"{p}mlp.{x}_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_block_model(config, qtype: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A model of `config` with random weights (std 0.05, norms 1) on the block kernels, every matrix quantized to
    `qtype` (Q8_0 or Q4_0): for measuring passes of a shape no real checkpoint here has (a mixture of experts)."""
    from specdec.models.llama import MoE, Transformer, meta_skeleton
    from specdec.models.loading import _FloatSource, build_quantized

    with meta_skeleton():
        skeleton = Transformer(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in skeleton.named_parameters():
        weights[name] = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.05
    for name, module in skeleton.named_modules():  # the block loader reads gate and up apart
        if isinstance(module, MoE):
            weights.pop(f"{name}.gate.weight")
            weights[f"{name}.gate.weight"] = torch.randn(config.num_experts, config.hidden_size, generator=gen)
    return build_quantized(config, _FloatSource(weights, qtype), dtype)
