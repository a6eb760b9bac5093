"""The decoder families specdec runs, each described once: what its layers are made of and how its checkpoints
name them. The layer code (`models/llama.py`), the config reader (`config.ModelConfig`) and the loaders
(`models/loading.py`) read these fields, never a family's name: adding a family is an entry here and its tests.

Every family is the same decoder (embeddings, then layers of attention and MLP around RMSNorms, a final norm,
an output layer); the fields say where one departs from Llama's. Example: Qwen3 is Llama with a bias-free
attention whose queries and keys are RMS-normed per head before rope (`qk_norm`); Gemma 3 adds norms after
attention and after the MLP (`sandwich_norms`), stores its norm weights less one (`norm_offset`), scales its
embeddings by sqrt(hidden) (`embed_scale`) and gates its MLP with tanh-GELU (per model, `hidden_act`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json's "architectures"[0]
    model_type: str  # config.json's "model_type"
    gguf_name: str  # GGUF's general.architecture
    qk_norm: bool = False  # per-head RMSNorm of q and k, before rope (`self_attn.q_norm`, `self_attn.k_norm`)
    sandwich_norms: bool = False  # norms on attention's and the MLP's outputs too, before each residual add
    norm_offset: float = 0.0  # Hugging Face checkpoints store every norm weight as w - offset (Gemma: x * (1 + w))
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the activations' dtype
    attention_bias: bool = False  # q/k/v carry a bias when config.json does not say (Qwen2)
    rope_permuted: bool = False  # llama.cpp's converter interleaved the q/k rows of each head in GGUF
    moe: bool = False  # mixture-of-experts MLPs: a router, top-k experts (`mlp.gate`, `mlp.experts.{e}.*`)
    # Hugging Face names -> specdec's, a substring each (Mixtral: block_sparse_moe.experts.0.w1 -> mlp.experts.0.gate_proj)
    hf_renames: tuple[tuple[str, str], ...] = ()
    # GGUF tensor kinds that mean something else in this family (Gemma 3's ffn_norm is the pre-MLP norm; Phi-3's
    # ffn_up holds gate and up)
    gguf_kinds: tuple[tuple[str, str], ...] = ()


_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_GEMMA_KINDS = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))

ARCHITECTURES: dict[str, Architecture] = {
    a.hf_name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "llama", rope_permuted=True),
        Architecture("MistralForCausalLM", "mistral", "mistral", rope_permuted=True),
        Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", attention_bias=True),
        Architecture("Qwen3ForCausalLM", "qwen3", "qwen3", qk_norm=True),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", qk_norm=True, moe=True),
        # llama.cpp writes Mixtral as `llama` with experts (`llama.expert_count`): see `gguf_architecture`
        Architecture("MixtralForCausalLM", "mixtral", "llama", rope_permuted=True, moe=True, hf_renames=_MIXTRAL_NAMES),
        # Phi-3's checkpoints hold q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (split or used as is)
        Architecture("Phi3ForCausalLM", "phi3", "phi3", gguf_kinds=(("ffn_up", "mlp.gate_up_proj"),)),
        Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3", qk_norm=True, sandwich_norms=True,
                     norm_offset=1.0, embed_scale=True, gguf_kinds=_GEMMA_KINDS),
    )
}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def architecture(hf_name: str) -> Architecture:
    """The family of a config.json "architectures" name; a clear error for the ones specdec does not run."""
    if hf_name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {hf_name!r}; specdec runs {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[hf_name]


def gguf_architecture(gguf_name: str, experts: int) -> Architecture:
    """The family of a GGUF's general.architecture (`experts`: its `{arch}.expert_count`, 0 if absent).
    Example: ("llama", 8) -> Mixtral; ("llama", 0) -> Llama."""
    if gguf_name == "llama" and experts:
        return ARCHITECTURES["MixtralForCausalLM"]
    for a in ARCHITECTURES.values():
        if a.gguf_name == gguf_name and not a.hf_renames:
            return a
    names = sorted({a.gguf_name for a in ARCHITECTURES.values()})
    raise ValueError(f"unsupported GGUF architecture {gguf_name!r}; specdec runs {', '.join(names)}")
