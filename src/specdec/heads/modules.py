"""Medusa heads and the EAGLE head: small modules on the target's last hidden state.

Both predict over a reduced output vocabulary (`vocab_ids`, e.g. the 8192 tokens the target emits most
often on the training corpus) with the target's own output-layer rows for those tokens, taken from the
target when the heads are attached: the files hold only what was trained, and a token outside the
reduced vocabulary is simply never drafted (drafts never change the output, only how often they agree).

- Medusa (Cai et al. 2024): head i is a residual block on the hidden state of token t and guesses token
  t + 2 + i (the target's own output layer guesses t + 1).
- EAGLE (Li et al. 2024): one decoder layer, run autoregressively on features. The input for token t is
  the target's hidden state of token t fused with the embedding of token t + 1; the output is the
  predicted hidden state of token t + 1, whose output-layer logits guess token t + 2.
- EAGLE-3 (Li et al. 2025): the same layer, but the target's feature of token t fuses low, middle and high
  layers (`feature_layers`: the outputs of those layers, each RMS-normed, then the final hidden state, one
  linear map to the hidden size), and the head is trained on its own outputs for several steps ("training-time
  test", `specdec.training.losses.ttt_losses`), so that its output is simply the next step's feature.

Heads are saved as `model.safetensors` + `config.json` naming the target and a fingerprint of its
weights; loading them for another target is refused (their folders, shipped or not: `specdec.heads.files`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.kernels.qgemm import Q4_0, quantize_q4_0, quantize_q8_0
from specdec.methods import HEAD_METHODS, METHODS, resolve
from specdec.models.kv_cache import KVCache
from specdec.models.llama import Attention, DecoderLayer, RMSNorm, attention_inputs, rope_inv_freq, rope_tables
from specdec.models.qlinear import Q8_0, QuantLinear, kernel_blocks

# the heads' matrices on the block kernels (`to_block_kernels`): Q8_0 (the default), or Q4_0 (about half the
# bytes a pass reads, the output rows too); drafts change with it, outputs never do
HEAD_FORMATS = {"q8_0": (quantize_q8_0, Q8_0), "q4_0": (quantize_q4_0, Q4_0)}


class HeadsMismatchError(ValueError):
    """The heads were trained for another target."""


@dataclass(frozen=True)
class HeadsConfig:
    method: str  # medusa | eagle
    target: str  # the target's name when the heads were trained
    target_fingerprint: str  # `target_fingerprint(target)` of that target
    hidden_size: int
    vocab_size: int  # reduced output vocabulary
    num_heads: int = 4  # medusa: one head per drafted position
    # eagle: the shape of its one decoder layer (attention as the target's)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # eagle, EAGLE-3 style: the target layers whose outputs are fused with its final hidden states into the
    # head's input feature (empty: the final hidden states alone, EAGLE-1)
    feature_layers: tuple[int, ...] = ()
    training: dict[str, Any] = field(default_factory=dict)  # the training report

    def __post_init__(self) -> None:
        _check_head_method(self.method)
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))  # (JSON: a list)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            architecture="LlamaForCausalLM",  # a head's layer is a Llama decoder layer
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    @classmethod
    def for_target(cls, method: str, target, target_name: str, vocab_size: int, **kw) -> "HeadsConfig":
        """Default head shapes for `target`: EAGLE attention like the target's, a narrow MLP."""
        c = target.config
        kw = {**head_class(method).default_shape(c), **kw}
        return cls(method, target_name, target_fingerprint(target), c.hidden_size, vocab_size, **kw)


def _check_head_method(method: str) -> None:
    if method not in HEAD_METHODS:
        raise ValueError(f"unknown head method {method!r}; choose one of {', '.join(HEAD_METHODS)}")


def head_class(method: str) -> type["_Head"]:
    """The class of heads method `method` (medusa: `MedusaHeads`, eagle: `EagleHead`), as its record in
    `specdec.methods` names it."""
    _check_head_method(method)
    return resolve(METHODS[method].heads_class)


def target_fingerprint(target) -> str:
    """sha256 of the target's shape and of weights no quantization touches (embedding rows, final norm),
    rounded to bf16: the same checkpoint gives the same fingerprint in fp32, bf16 or int8."""
    c = target.config
    digest = hashlib.sha256(
        json.dumps([c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads]).encode()
    )
    stride = max(1, c.vocab_size // 256)
    rows = target.embed(torch.arange(0, c.vocab_size, stride, device=target.device))
    for t in (rows, target.final_norm_weight):
        digest.update(t.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


class _Head(nn.Module):
    """What both kinds share: the reduced vocabulary and the target's rows for it."""

    keeps_kv = False  # whether drafting keeps a K/V cache (EAGLE's layer; Medusa's blocks read one state)

    @staticmethod
    def default_shape(c: ModelConfig) -> dict[str, Any]:
        """`HeadsConfig` fields these heads take from the target `c` by default (`HeadsConfig.for_target`)."""
        return {}

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("vocab_ids", torch.arange(config.vocab_size))
        self.register_buffer("lm_rows", torch.zeros(config.vocab_size, config.hidden_size), persistent=False)
        self.lm_head: QuantLinear | None = None  # the target's own blocks for these rows (see to_block_kernels)
        self.dtype = torch.float32  # of the activations; set by attach
        self.weight_format = "none"  # of the matrices: float, or a `HEAD_FORMATS` key (`to_block_kernels`)

    def attach(self, target) -> "_Head":
        """Take the target's output rows (and embedding, for EAGLE); move to its device and dtype."""
        self.to(device=target.device)
        self.dtype = next(self.parameters()).dtype
        self.lm_rows = target.output_weights(self.vocab_ids).to(target.device, self.dtype)
        return self

    def to_block_kernels(self, target, fmt: str = "q8_0") -> "_Head":
        """Run on the target's block kernels (a target loaded from GGUF blocks): every matrix in `fmt`
        (`HEAD_FORMATS`), the output layer the target's own blocks for the reduced vocabulary (with "q4_0",
        rows of more than Q4_0's 4.5 bits a weight requantized to Q4_0, as a draft model's are). Inference only."""
        quantize, qtype = HEAD_FORMATS[fmt]
        self.weight_format = fmt
        self.lm_head = target.output_rows(self.vocab_ids)
        if fmt == "q4_0":
            lm = self.lm_head
            parts = [kernel_blocks(w, t, lm.in_features, Q4_0) for w, t in zip(lm.blocks, lm.types)]
            self.lm_head = QuantLinear(parts, lm.in_features, lm.bias)
        self.lm_rows = torch.zeros(0, self.config.hidden_size, dtype=self.dtype)
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                    blocks = quantize(child.weight.detach().float())
                    bias = None if child.bias is None else child.bias.detach().float()
                    setattr(parent, name, QuantLinear([(blocks, qtype)], child.in_features, bias))
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., vocab_size] fp32 logits over the reduced vocabulary."""
        if self.lm_head is not None:
            return self.lm_head(hidden.to(self.dtype)).float()
        return torch.matmul(hidden.to(self.lm_rows.dtype), self.lm_rows.t()).float()

    def expand(self, reduced: torch.Tensor, vocab: int) -> torch.Tensor:
        """Reduced logits [..., vocab_size] -> [..., vocab] over the target's vocabulary, -inf outside."""
        out = reduced.new_full((*reduced.shape[:-1], vocab), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids, reduced)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised: a new head starts as the target's own output layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(_Head):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] (the target's final hidden state of token t) -> logits [..., n, vocab_size] of the
        first n = num_heads (default: all) heads; head i guesses token t + 2 + i. The heads' states go through
        the output layer together: one pass over its rows for all of them."""
        blocks = self.blocks[:num_heads]
        return self.logits(torch.stack([block(hidden) for block in blocks], dim=-2))


class EagleHead(_Head):
    keeps_kv = True

    @staticmethod
    def default_shape(c: ModelConfig) -> dict[str, Any]:
        """Attention like the target's, a narrow MLP."""
        return {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "intermediate_size": max(64, c.hidden_size * 2 // 3),
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta}

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H)
        parts = len(config.feature_layers) + 1
        if parts > 1:  # EAGLE-3: the target's features of several layers -> one feature
            self.feature_norms = nn.ModuleList(RMSNorm(H, config.rms_norm_eps) for _ in range(parts - 1))
            self.fuse = nn.Linear(parts * H, H, bias=False)
        self.layer = DecoderLayer(config.layer_config(), 0)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(config.layer_config()), persistent=False)
        self.embed = None  # the target's token embedding rows (`TokenRows`), set by attach (not saved)

    def attach(self, target) -> "EagleHead":
        super().attach(target)
        self.embed = TokenRows(target.embed)
        self.inv_freq = rope_inv_freq(self.config.layer_config()).to(target.device)
        return self

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input feature [..., H] of the target's states [..., F] (the outputs of `feature_layers`,
        then the final hidden state; F = H without feature layers, when this is the identity)."""
        if not self.config.feature_layers:
            return hidden
        *layers, final = hidden.to(self.dtype).split(self.config.hidden_size, -1)
        return self.fuse(torch.cat([norm(p) for norm, p in zip(self.feature_norms, layers)] + [final], -1))

    def init_from_eagle(self, other: "EagleHead") -> None:
        """Start from a trained EAGLE-1 head of the same shape: its layer, fc, norm and vocabulary, and a
        fusion that passes the final hidden state through (the layers' parts weighted 0), so that the new
        head starts out computing exactly what `other` computes. An EAGLE-3 head over the same layers is
        taken whole. A head with a wider MLP than `other`'s is grown: `other`'s units first, the new units'
        gate and up rows as initialized and their down columns 0, so it too starts out as `other`."""
        self.vocab_ids = other.vocab_ids.clone()
        if other.config.feature_layers and other.config.feature_layers != self.config.feature_layers:
            raise ValueError(f"an EAGLE-3 head over layers {other.config.feature_layers} cannot start one "
                             f"over {self.config.feature_layers}")
        width, start_width = self.config.intermediate_size, other.config.intermediate_size
        if start_width > width:
            raise ValueError(f"an EAGLE head with an MLP of {start_width} units cannot start one of {width}")
        mlp = ("layer.mlp.gate_proj.", "layer.mlp.up_proj.", "layer.mlp.down_proj.")
        fusion = ("fuse.", "feature_norms.")  # (EAGLE-1 has none)
        state = {k: v for k, v in other.state_dict().items()
                 if not k.startswith(mlp) and (other.config.feature_layers or not k.startswith(fusion))}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith(mlp + fusion) for k in missing):
            raise ValueError(f"the EAGLE head to start from does not match: {sorted(missing + unexpected)[:4]}")
        theirs = other.layer.mlp
        with torch.no_grad():
            for name in ("gate_proj", "up_proj"):
                getattr(self.layer.mlp, name).weight[:start_width] = getattr(theirs, name).weight
            self.layer.mlp.down_proj.weight.zero_()
            self.layer.mlp.down_proj.weight[:, :start_width] = theirs.down_proj.weight
            if not other.config.feature_layers:
                H = self.config.hidden_size
                self.fuse.weight.zero_()
                self.fuse.weight[:, -H:] = torch.eye(H)

    def new_cache(self, batch_size: int, capacity: int, num_pages: int | None = None) -> KVCache:
        return KVCache(self.config.layer_config(), batch_size, capacity, self.dtype, self.vocab_ids.device, num_pages)

    def to_block_kernels(self, target, fmt: str = "q8_0") -> "EagleHead":
        """As `_Head.to_block_kernels`, and the decoder layer run as the target's layers run: Q/K/V and
        gate/up as one matrix each, norms, rope and attention as CPU ops, the whole layer as one op
        (`DecoderLayer.fuse`), so a head pass is one kernel call for the layer instead of a dozen torch ops
        and a Python loop over query blocks."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        if self.config.hidden_size % 32 or self.config.intermediate_size % 32 or attn.o_proj.in_features % 32:
            return super().to_block_kernels(target, fmt)  # rows that do not fill blocks stay float
        attn.fuse_qkv(_block_linear([attn.q_proj, attn.k_proj, attn.v_proj], fmt))
        mlp.fuse_gate_up(_block_linear([mlp.gate_proj, mlp.up_proj], fmt))
        super().to_block_kernels(target, fmt)  # fc, fuse, o_proj, down_proj
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.fused = True
        self.layer.fuse()
        return self

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] feature of token t (the target's, `features`, or predicted)
        next_tokens: torch.Tensor,  # [B, T] token t + 1
        positions: torch.Tensor,  # [B, T]
        cache: KVCache,
        mask: torch.Tensor | None = None,  # [B, T, T] among the new inputs (None: causal); with slots: [B, T, S]
        slots: torch.Tensor | None = None,  # [B, T] the cache slot of each input's K/V
    ) -> torch.Tensor:
        """The predicted hidden state of token t + 1, [B, T, H]. Like `Transformer.forward`, writes the new
        K/V past each row's committed length and commits nothing. With `slots`, the K/V go to those slots and
        `mask` [B, T, S] says which of the cache's first S slots each input attends, in slot order: how draft
        nodes are kept in the cache from one depth to the next, each attending its row's committed pairs and
        its ancestors (example: pairs in slots 0..9, nodes 0, 1 (children of the root) and 2 (a child of 0)
        in slots 10, 11, 12; node 2's mask row sees slots 0..10 and 12)."""
        dtype = self.dtype
        x = torch.cat([features.to(dtype), self.embed(next_tokens).to(dtype)], -1)
        if slots is not None:
            cos, sin = rope_tables(positions, self.inv_freq, dtype)
            cache.reserve_slots(slots)
            return self.norm(self.layer(self.fc(x), cos, sin, cache, slots, mask, None, slots))
        cos, sin, write_slots, full_mask, key_index = attention_inputs(cache, positions, mask, self.inv_freq, dtype)
        slots = write_slots  # (the fused layer's write slots: rows of equal length take the next T of each)
        if slots is None and self.layer.fused_args is not None:
            B, T = next_tokens.shape
            slots = cache.lengths[0] + torch.arange(T, device=next_tokens.device).expand(B, T)
        h = self.layer(self.fc(x), cos, sin, cache, write_slots, full_mask, key_index, slots)
        return self.norm(h)

    def write_kv(
        self,
        features: torch.Tensor,  # [B, T, H]
        next_tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache,
        slots: torch.Tensor,  # [B, T] the cache slot of each input's K/V
    ) -> None:
        """Only the K/V that `forward` writes for these inputs, bit for bit, without their predictions: a
        prompt's pairs, of which only the last one's prediction is wanted, at about half a pass's cost."""
        dtype = self.dtype
        x = torch.cat([features.to(dtype), self.embed(next_tokens).to(dtype)], -1)
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        self.layer.write_kv(self.fc(x), cos, sin, cache, slots)


class TokenRows:
    """The target's embedding rows of the tokens the head reads, the most recent `size` kept: a lookup in the
    target's GGUF blocks dequantizes in some twenty torch ops (~0.2 ms, as much for 1 token as for 100), where
    a draft pass reads 1 to 3 tokens, most of them seen before. Rows are the lookup's own, bit for bit."""

    def __init__(self, embed, size: int = 1024) -> None:
        self.embed, self.size = embed, size
        self.rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # token -> [H]
        self.row_bytes = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[*ids.shape, H]: the embedding rows of `ids`."""
        flat = ids.reshape(-1).tolist()
        if len(flat) > self.size:  # (a prompt): one lookup
            return self.embed(ids)
        missing = [t for t in dict.fromkeys(flat) if t not in self.rows]
        if missing:
            for t, row in zip(missing, self.embed(torch.tensor(missing, device=ids.device))):
                self.rows[t] = row
            self.row_bytes = row.numel() * row.element_size()
        for t in flat:
            self.rows.move_to_end(t)
        while len(self.rows) > self.size:
            self.rows.popitem(last=False)
        return torch.stack([self.rows[t] for t in flat]).reshape(*ids.shape, -1)

    @property
    def nbytes(self) -> int:
        """The most the kept rows take."""
        return self.size * self.row_bytes


def _block_linear(linears: list[nn.Linear], fmt: str) -> QuantLinear:
    """One `QuantLinear` in `fmt` computing concat(linear(x) for linears), biases concatenated (all or none)."""
    quantize, qtype = HEAD_FORMATS[fmt]
    parts = [(quantize(m.weight.detach().float()), qtype) for m in linears]
    biases = [m.bias for m in linears if m.bias is not None]
    bias = torch.cat([b.detach().float() for b in biases]) if biases else None
    return QuantLinear(parts, linears[0].in_features, bias)


def head_bytes(head: nn.Module) -> int:
    """Memory of the heads: their weights and buffers (the target's output rows for their vocabulary
    included, as a float copy or as blocks), each tensor counted once."""
    tensors = {t.data_ptr(): t for t in itertools.chain(head.parameters(), head.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
