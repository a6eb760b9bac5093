"""Checkpoints in: Hugging Face folders (safetensors) and GGUF files -> (ModelConfig, state dict, Tokenizer).

State-dict keys follow Hugging Face naming (`model.layers.{i}.self_attn.q_proj.weight`, ...); `lm_head.weight`
is absent when the embeddings are tied. Pickled checkpoints (`.bin`, `.pt`) are refused: loading them can run
arbitrary code. A GGUF can also be converted once into a float32 Hugging Face folder (`convert_gguf`), which
then reloads in about a second.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specdec.architectures import Architecture, gguf_architecture
from specdec.config import ModelConfig
from specdec.kernels.qgemm import quantize_q4_0, quantize_q8_0
from specdec.models.cpu import cpu_has_native_bf16
from specdec.models.dequant import dequantize
from specdec.models.gguf_file import GGUFFile
from specdec.models.llama import Attention, MoE, RMSNorm, Transformer, meta_skeleton
from specdec.models.qlinear import Q4_0, Q8_0, QuantEmbedding, QuantLinear, kernel_blocks
from specdec.models.tokenizer import Tokenizer, gguf_eos_token_ids, gguf_field

MAX_SHARD_BYTES = 4 << 30
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is bfloat16 on CUDA, and on CPUs with native bf16 (AVX-512 BF16 / AMX), else float32.

    Example: resolve_dtype("auto", torch.device("cpu")) -> torch.float32 on an AVX2-only CPU.
    """
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


# ---- entry points ---------------------------------------------------------------------------------


def load_config(path: str | Path) -> ModelConfig:
    """The model's config alone: reads `config.json`, or a GGUF's metadata."""
    path = _checked_path(path)
    if path.suffix == ".gguf":
        return gguf_config(GGUFFile(path))
    return hf_config(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer alone: a GGUF's `tokenizer.ggml.*` metadata, or a folder's tokenizer files."""
    path = _checked_path(path)
    return Tokenizer.from_gguf(GGUFFile(path)) if path.suffix == ".gguf" else Tokenizer.from_folder(path)


def load_checkpoint(
    path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", progress: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (each cast to `dtype` on `device` as it is read) and tokenizer of a checkpoint.

    `path` is a Hugging Face folder (config.json, safetensors shards, tokenizer.json) or a `.gguf` file.
    """
    path = _checked_path(path)
    if path.suffix == ".gguf":
        reader = GGUFFile(path)
        config = gguf_config(reader)
        weights = {name: t.to(device=device, dtype=dtype) for name, t in gguf_tensors(reader, config, progress)}
        return config, split_fused(config, weights), Tokenizer.from_gguf(reader)
    config = hf_config(path)
    return config, split_fused(config, load_safetensors(path, config, dtype, device)), Tokenizer.from_folder(path)


def _checked_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"refusing {path.name}: pickled checkpoints can run code when loaded; use safetensors or GGUF")
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: it has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path.name}: expected a model folder or a .gguf file")
    return path


# ---- Hugging Face folders -------------------------------------------------------------------------


def hf_config(folder: Path) -> ModelConfig:
    """`config.json`, with the eos ids of `generation_config.json` when present (what generate stops on)."""
    cfg = json.loads((folder / "config.json").read_text())
    gen_path = folder / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
    return ModelConfig.from_hf(cfg if gen_eos is None else {**cfg, "eos_token_id": gen_eos})


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by `model.safetensors.index.json`, else every `*.safetensors` in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f" (found {', '.join(pickles)}: pickles are refused, convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"{folder} has no .safetensors weights{hint}")
    return files


def load_safetensors(folder: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Tensor by tensor, each cast at once: peak memory is about the final size, not the stored size. Names and
    norm weights as specdec's layers read them (`config.arch`: Mixtral's experts renamed, Gemma's norms plus one)."""
    arch = config.arch
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                w = f.get_tensor(name)
                for old, new in arch.hf_renames:
                    name = name.replace(old, new)
                if arch.norm_offset and name.endswith("norm.weight"):  # in fp32, as transformers adds it
                    w = w.float() + arch.norm_offset
                weights[name] = w.to(device=device, dtype=dtype)
    return weights


def split_fused(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints holding q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3) -> the separate
    matrices the float layers read (the block kernels use the fused ones as they are). In place; returns it."""
    sizes = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), [config.num_attention_heads * config.head_dim]
                                    + [config.num_key_value_heads * config.head_dim] * 2),
             "mlp.gate_up_proj": (("gate_proj", "up_proj"), [config.intermediate_size] * 2)}
    for name in [n for n in weights if n.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj")]:
        module, kind = name.rsplit(".", 1)
        parent, fused = module.rsplit(".", 1)
        names, split = sizes[f"{parent.rsplit('.', 1)[-1]}.{fused}"]
        for part, w in zip(names, weights.pop(name).split(split)):
            weights[f"{parent}.{part}.{kind}"] = w
    return weights


# ---- GGUF -----------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k, v in one matrix
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# a mixture of experts' matrices, all experts in one 3-D tensor each: expert e's is the e-th slice
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: Architecture | None = None) -> str:
    """GGUF tensor name -> Hugging Face name (as `arch` names its parts). Example: `blk.3.ffn_gate.weight` ->
    `model.layers.3.mlp.gate_proj.weight`; for Gemma 3, `blk.3.ffn_norm.weight` ->
    `model.layers.3.pre_feedforward_layernorm.weight`. Experts' merged tensors: see `expert_names`."""
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    kinds = {**_GGUF_LAYER_NAMES, **dict(arch.gguf_kinds if arch else ())}
    if m is None or m.group(2) not in kinds:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for {arch.hf_name if arch else 'this architecture'}")
    return f"model.layers.{m.group(1)}.{kinds[m.group(2)]}.{m.group(3)}"


def expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The per-expert Hugging Face names of a merged experts tensor, None for any other tensor. Example:
    `blk.1.ffn_up_exps.weight`, 2 -> [`model.layers.1.mlp.experts.0.up_proj.weight`, `...experts.1.up_proj.weight`]."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _GGUF_EXPERTS:
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{_GGUF_EXPERTS[m.group(2)]}.{m.group(3)}" for e in range(experts)]


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, ...); tied embeddings = no `output.weight`.
    Where llama.cpp fixes a value in code rather than in the file, the same value: Gemma 3's sliding layers
    (five of each six), their rope base (10,000) and its query scale (head_dim's; 27B's hidden / heads)."""
    name = gguf_field(reader, "general.architecture")
    get = lambda key, default=None: gguf_field(reader, f"{name}.{key}", default)  # noqa: E731
    arch = gguf_architecture(name, get("expert_count", 0))
    names = {t.name for t in reader.tensors}
    for unsupported in ("rope_freqs.weight", "rope_factors_long.weight"):
        if unsupported in names:
            raise NotImplementedError(f"GGUF with {unsupported} (Llama 3.1 / Phi-3 long rope) is not supported yet")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_heads, hidden, layers = get("attention.head_count"), get("embedding_length"), get("block_count")
    head_dim = get("attention.key_length", hidden // n_heads)
    window, types, extra = get("attention.sliding_window"), (), {}
    if arch.hf_name == "Gemma3ForCausalLM":
        pattern = get("attention.sliding_window_pattern", 6)
        types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
        extra = dict(hidden_act="gelu_tanh", rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
                     query_pre_attn_scalar=hidden // n_heads if layers == 62 else head_dim)
    elif window:  # Phi-3: every layer
        types = ("sliding_attention",) * layers
    experts = get("expert_count", 0)
    if experts:
        extra.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                     moe_intermediate_size=get("expert_feed_forward_length", get("feed_forward_length")),
                     norm_topk_prob=bool(get("expert_weights_norm", True)))
    return ModelConfig(
        architecture=arch.hf_name,
        vocab_size=int(embed.shape[1]),  # GGUF dims are [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", get("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rms_norm_eps=_shortest_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(get),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_eos_token_ids(reader),
        layer_types=types if window else (),
        sliding_window=window if types else None,
        **extra,
    )


def _shortest_f32(x: float) -> float:
    """The shortest decimal that a float32 metadata value stands for. Example: 9.99999997e-07 -> 1e-06."""
    return float(str(np.float32(x)))


def _gguf_rope_scaling(get) -> dict | None:
    """`{arch}.rope.scaling.*` -> a transformers `rope_scaling` dict (None when absent or `none`)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported; specdec reads linear and yarn")
    scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    return scaling


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved rope pairs -> rotate-half halves.

    w: [n_heads * head_dim, ...] (weight or bias). llama.cpp stores the rows of each head as
    (0, d/2, 1, d/2+1, ...); Hugging Face wants (0, 1, ..., d/2-1, d/2, ...). Example, head_dim 4:
    stored rows [r0, r2, r1, r3] -> [r0, r1, r2, r3].
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(reader: GGUFFile, config: ModelConfig, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized one at a time (a merged
    experts tensor: one per expert)."""
    arch = config.arch
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = dequantize(t.data, t.tensor_type, shape)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if arch.rope_permuted and kind in heads:
            w = unpermute_rope(w, heads[kind])
        experts = expert_names(t.name, config.num_experts)
        if experts is not None:
            yield from zip(experts, w.unbind(0))
        else:
            yield hf_name(t.name, arch), w


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a GGUF as a Hugging Face folder: config.json, float32 safetensors (sharded above 4 GiB),
    tokenizer files and generation_config.json. Float32 keeps the dequantized values exact.

    Everything is written into a sibling `.<name>.partial` folder renamed at the end, so a crash never
    leaves a folder that looks complete. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir).expanduser()
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it to convert again")
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        reader = GGUFFile(gguf_path)
        config = gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        _write_shards(reader, config, tmp, progress)
        _write_json(tmp / "config.json", {**config.to_hf(), "torch_dtype": "float32"})
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
            "pad_token_id": tokenizer.pad_token_id,
        })
        tokenizer.save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out_dir)
    return out_dir


def plan_shards(sizes: list[int], max_bytes: int = MAX_SHARD_BYTES) -> list[int]:
    """Shard index of each tensor, filling shards in order up to `max_bytes`.

    Example, max 4 GiB: sizes [3, 2, 1, 3] GiB -> [0, 1, 1, 2].
    """
    plan, index, used = [], 0, 0
    for size in sizes:
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        plan.append(index)
        used += size
    return plan


def _write_shards(reader: GGUFFile, config: ModelConfig, folder: Path, progress: bool) -> None:
    """Dequantize and save one shard at a time: peak memory is one shard, not the whole model."""
    sizes = []  # float32, as `gguf_tensors` yields them (a merged experts tensor: one per expert)
    for t in reader.tensors:
        n = int(t.shape[2]) if len(t.shape) == 3 else 1
        sizes += [int(t.n_elements) * 4 // n] * n
    plan = plan_shards(sizes, MAX_SHARD_BYTES)
    n = plan[-1] + 1
    files = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    for index, (name, tensor) in zip(plan, gguf_tensors(reader, config, progress)):
        if shard and files[index] != weight_map[next(iter(shard))]:
            save_file(shard, str(folder / weight_map[next(iter(shard))]), metadata={"format": "pt"})
            shard = {}
        shard[name], weight_map[name] = tensor.contiguous(), files[index]
    save_file(shard, str(folder / files[-1]), metadata={"format": "pt"})
    if n > 1:
        index_json = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index_json)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ---- quantized models: weights in GGUF blocks ----------------------------------------------------


class _GGUFSource:
    """A GGUF's tensors by Hugging Face name, as memory-mapped uint8 rows of blocks (no copy)."""

    def __init__(self, reader: GGUFFile, config: ModelConfig) -> None:
        self.tensors = {}  # name -> (tensor, expert index or None: the whole tensor)
        for t in reader.tensors:
            experts = expert_names(t.name, config.num_experts)
            for e, name in enumerate(experts) if experts is not None else [(None, hf_name(t.name, config.arch))]:
                self.tensors[name] = (t, e)
        self.heads = {}
        if config.arch.rope_permuted:
            self.heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _rows(self, name: str, w: torch.Tensor) -> torch.Tensor:
        kind = name.split(".")[-2]
        return unpermute_rope(w, self.heads[kind]).contiguous() if kind in self.heads else w

    def blocks(self, name: str) -> tuple[torch.Tensor, int, int]:
        """(uint8 [rows, row_bytes], GGML type, values per row)."""
        t, expert = self.tensors[name]
        dims = [int(d) for d in t.shape]  # innermost first: [row_len, rows] or [row_len, rows, experts]
        row_len, rows = dims[0], dims[1]
        raw = torch.from_numpy(t.data.reshape(-1).view(np.uint8))
        raw = raw.reshape(dims[2] if len(dims) == 3 else 1, rows, -1)[expert or 0]
        return self._rows(name, raw), int(t.tensor_type), row_len

    def vector(self, name: str) -> torch.Tensor:
        t, _ = self.tensors[name]
        return self._rows(name, dequantize(t.data, t.tensor_type, (int(t.n_elements),)))


class _FloatSource:
    """A float state dict, quantized to `qtype` (Q8_0 or Q4_0) matrix by matrix as the model is built."""

    def __init__(self, weights: dict[str, torch.Tensor], qtype: int = Q8_0) -> None:
        self.weights = weights
        self.qtype = qtype

    def has(self, name: str) -> bool:
        return name in self.weights

    def blocks(self, name: str) -> tuple[torch.Tensor, int, int]:
        w = self.weights.pop(name)  # the float copy is freed as soon as it is quantized
        quantize = quantize_q4_0 if self.qtype == Q4_0 else quantize_q8_0
        return quantize(w), self.qtype, int(w.shape[1])

    def vector(self, name: str) -> torch.Tensor:
        return self.weights[name].float()


# block format -> the type every matrix is requantized to (None: the file's own where the kernels run it)
REQUANTIZE = {"gguf": None, "q8_0": Q8_0, "q4_0": Q4_0}


def fp32_residual() -> bool:
    """Whether block-kernel models keep their residual stream in fp32: yes, as llama.cpp (closer to fp32,
    docs/numerics.md), unless `SPECDEC_FP32_RESIDUAL=0` (bf16 between the ops: other K/V bits)."""
    return os.environ.get("SPECDEC_FP32_RESIDUAL", "1") not in ("", "0")


def load_quantized(
    path: str | Path, method: str = "gguf", dtype: torch.dtype = torch.bfloat16, residual_dtype: torch.dtype | None = None
) -> tuple[ModelConfig, Transformer, Tokenizer]:
    """A model whose matrices run on specdec's block kernels, activations in `dtype`; `residual_dtype` (default:
    fp32 if `fp32_residual()`, else `dtype`): its residual stream, norms and embeddings (`build_quantized`).

    method `gguf`: a GGUF's own blocks, used in place from a memory map (types the kernels lack are
    requantized to Q8_0); `q8_0` / `q4_0`: every matrix requantized to Q8_0 / Q4_0 (from the file's values:
    Q4_0 is a smaller, faster draft, at some cost in agreement). A Hugging Face folder (float safetensors)
    is quantized to Q8_0 (`gguf`, `q8_0`) or Q4_0.
    """
    if method not in REQUANTIZE:
        raise ValueError(f"unknown block format {method!r}; choose {', '.join(REQUANTIZE)}")
    path = _checked_path(path)
    if path.suffix == ".gguf":
        reader = GGUFFile(path)
        config = gguf_config(reader)
        with warnings.catch_warnings():  # a read-only map: the kernels never write the weights
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            model = build_quantized(config, _GGUFSource(reader, config), dtype, requantize=REQUANTIZE[method],
                                    residual_dtype=residual_dtype)
        tokenizer = Tokenizer.from_gguf(reader)
        reader.release_pages()
        return config, model, tokenizer
    config = hf_config(path)
    weights = load_safetensors(path, config, torch.float32, "cpu")
    source = _FloatSource(weights, REQUANTIZE[method] or Q8_0)
    return config, build_quantized(config, source, dtype, residual_dtype=residual_dtype), Tokenizer.from_folder(path)


def build_quantized(config: ModelConfig, source, dtype: torch.dtype, requantize: int | None = None,
                    residual_dtype: torch.dtype | None = None) -> Transformer:
    """A Transformer with QuantLinear matrices (Q/K/V fused, gate/up fused) and a QuantEmbedding; every
    matrix requantized to type `requantize` when given (see `kernel_blocks`). `residual_dtype` fp32: the residual
    stream, norms and embeddings in fp32, as llama.cpp keeps them, so that only the matrices' inputs are rounded
    (to 8 bits) and the K/V cache's rows (to `dtype`); default: fp32 if `fp32_residual()`, else `dtype`."""
    with meta_skeleton():
        model = Transformer(config)
    wide = residual_dtype or (torch.float32 if fp32_residual() else dtype)
    if wide != dtype:
        model.residual_dtype, model.edge_dtype = wide, dtype
    else:
        model.residual_dtype = None

    def linear(names: list[str], bias_names: list[str] | None = None) -> QuantLinear:
        parts = []
        for name in names:
            blocks, qtype, row_len = source.blocks(name)
            parts.append(kernel_blocks(blocks, qtype, row_len, requantize))
        bias = torch.cat([source.vector(n) for n in bias_names]) if bias_names else None
        return QuantLinear(parts, row_len, bias)

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(source.vector(name).to(wide), requires_grad=False)

    def mlp_blocks(module: nn.Module, prefix: str) -> None:  # an MLP's matrices, gate and up as one
        fused = prefix + "gate_up_proj.weight"  # (Phi-3's checkpoints hold them so)
        module.fuse_gate_up(linear([fused] if source.has(fused) else [prefix + "gate_proj.weight", prefix + "up_proj.weight"]))
        module.down_proj = linear([prefix + "down_proj.weight"])

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        fused = attn + "qkv_proj.weight"
        qkv = [fused] if source.has(fused) else [f"{attn}{x}_proj.weight" for x in "qkv"]
        bias = [f"{attn}{x}_proj.bias" for x in "qkv"] if config.attention_bias else None
        layer.self_attn.fuse_qkv(linear(qkv, bias))
        layer.self_attn.o_proj = linear([attn + "o_proj.weight"])
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate = linear([mlp + "gate.weight"])
            for e, expert in enumerate(layer.mlp.experts):
                mlp_blocks(expert, f"{mlp}experts.{e}.")
        else:
            mlp_blocks(layer.mlp, mlp)
    for name, module in model.named_modules():  # every norm the family has
        if isinstance(module, RMSNorm):
            module.weight = norm(name + ".weight")
    for module in model.modules():  # the elementwise work as one CPU op each, like the matmuls
        if isinstance(module, (RMSNorm, Attention)):
            module.fused = True
    for layer in model.model.layers:  # and each layer as one op (computing in its input's dtype)
        layer.fuse()
    head = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
    model.lm_head = linear([head])  # before the embedding: a float source hands each matrix over once
    if head == "model.embed_tokens.weight":
        table, qtype = model.lm_head.blocks[0], model.lm_head.types[0]
    else:
        table, qtype, _ = source.blocks("model.embed_tokens.weight")
    model.model.embed_tokens = QuantEmbedding(table, qtype, config.vocab_size, config.hidden_size, wide)
    model.set_rope()
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(f"checkpoint lacks {len(meta)} tensors, e.g. {meta[:3]}")
    return model.eval()
