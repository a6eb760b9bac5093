"""The decoder of every family specdec runs (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Phi-3, Gemma 3) in
plain PyTorch: one layer code that reads what a family's layers are made of from `config.arch`
(`specdec.architectures`), never its name.

`forward(tokens, positions, cache, mask)` computes logits and keeps no bookkeeping: it writes the K/V
of its T new tokens into the cache slots just past each row's committed length and attends over the
committed prefix plus those new slots, as `mask` allows. The engine alone commits or rolls back.

Attention on CPU is computed as bf16 matmuls with an fp32 softmax (as transformers' eager path does), in
calls of one shape per key count (`Attention._exact_attention`). Unlike `F.scaled_dot_product_attention`,
whose CPU kernels block the work by query and key counts, this gives every query row the same bits whatever
the number of rows, the key length or the batch it is computed in; so a target that verifies 6 tokens at
once rounds exactly like one that decodes 1, and a prefix restored from the prefix cache is what prefilling
it would write (see `tests/test_exactness.py`). On CUDA, `F.scaled_dot_product_attention` is used with the
same mask.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from specdec.config import ModelConfig
from specdec.kernels import qgemm
from specdec.models.cpu import use_one_bf16_matmul_kernel
from specdec.models.kv_cache import KEY_BLOCK, KVCache
from specdec.models.qlinear import QuantEmbedding, QuantLinear
from specdec.models.quant import Int8Linear


QUERY_BLOCK = 8  # queries per attention matmul on CPU (padded): one shape per key count (see `_exact_attention`)


def _runs(values: list[int], size: int) -> list[list[int]]:
    """Indices of runs of equal consecutive values, cut every `size` indices: _runs([5, 5, 5, 7], 2) ->
    [[0, 1], [2], [3]]."""
    runs: list[list[int]] = []
    for i, v in enumerate(values):
        if runs and values[runs[-1][0]] == v and len(runs[-1]) < size:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, T, head_dim] of rope at `positions` [B, T] (`inv_freq` [head_dim // 2])."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def attention_inputs(
    cache: KVCache,
    positions: torch.Tensor,  # [B, T] rope positions of the new tokens
    mask: torch.Tensor | None,  # [B, T, T] bool among the new tokens; None: causal
    inv_freq: torch.Tensor,  # [head_dim // 2]
    dtype: torch.dtype,
):
    """What every layer of one pass needs: rope (cos, sin), the write slots, the key mask, and, for a
    tree pass on CPU, each query's key slots (see `Attention._exact_tree_attention`).

    Returns cos, sin [B, T, head_dim]; write_slots [B, T] or None (rows of equal length write a slice);
    mask [B, T, S] over key slots; key_index [B, T, S] or None.
    """
    B, T = positions.shape
    lengths = cache.lengths[:B]
    if max(lengths) + T > cache.capacity:
        raise ValueError(f"sequence of {max(lengths) + T} tokens exceeds the KV cache capacity of {cache.capacity}")
    for row, length in enumerate(lengths):  # the pages of the slots this pass writes
        cache.reserve(row, length + T)
    # Attend over whole blocks of KEY_BLOCK slots (the extra ones masked): every softmax row then has a
    # length that is a multiple of the vector width, so each score takes the same (vectorized) exp
    # whatever the number of rows in the pass; a row's result must not depend on it.
    S = -(-(max(lengths) + T) // KEY_BLOCK) * KEY_BLOCK
    device = positions.device
    lens = torch.tensor(lengths, device=device)  # [B]
    slot = torch.arange(S, device=device)  # [S]
    write_slots = None if min(lengths) == max(lengths) else lens[:, None] + torch.arange(T, device=device)
    cos, sin = rope_tables(positions, inv_freq, dtype)

    new_idx = slot[None, :] - lens[:, None]  # [B, S] index among new tokens, <0 for committed
    if mask is not None and device.type == "cpu":  # a tree: keys of each node in chain order
        visible = mask.sum(-1)  # [B, T] ancestors + self
        order = torch.where(mask, torch.arange(T, device=device), T).sort(dim=-1).values  # ancestors first, by index
        new_key = new_idx[:, None, :].expand(B, T, S)  # [B, T, S]
        in_path = (new_key >= 0) & (new_key < visible[..., None])
        path_slot = lens[:, None, None] + torch.gather(order, 2, new_key.clamp(0, T - 1))
        key_index = torch.where(in_path, path_slot, slot.expand(B, T, S))
        full_mask = (new_key < 0) | in_path
        return cos, sin, write_slots, full_mask, key_index
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril_().expand(B, T, T)
    in_new = (new_idx >= 0) & (new_idx < T)  # [B, S]
    gathered = torch.gather(mask, 2, new_idx.clamp(0, T - 1)[:, None, :].expand(B, T, S))
    full_mask = (new_idx < 0)[:, None, :] | (in_new[:, None, :] & gathered)  # [B, T, S]
    return cos, sin, write_slots, full_mask, None


def window_mask(
    mask: torch.Tensor,  # [B, T, S] what a full-attention layer sees
    positions: torch.Tensor,  # [B, T] the new tokens' positions
    lengths: list[int],  # each row's committed length
    key_index: torch.Tensor | None,  # [B, T, S] (tree passes on CPU) the slot of each query's key s
    window: int,
) -> torch.Tensor:
    """`mask` less the keys more than `window` - 1 positions behind each query (a sliding-window layer's view,
    transformers' and llama.cpp's rule: key k visible to query q iff q - k < window). A committed slot s holds
    position s, a new token's slot its position in `positions` (a tree node's is its depth's, not its index's).
    Example, window 2, one row, 3 committed + 2 new at positions 3, 4: query 4 sees slots 3 and 4 only."""
    B, T, S = mask.shape
    slot = torch.arange(S, device=mask.device).expand(B, S)
    lens = torch.tensor(lengths[:B], device=mask.device)[:, None]
    new = (slot - lens).clamp(0, T - 1)
    key_pos = torch.where(slot < lens, slot, torch.gather(positions, 1, new))  # [B, S]
    key_pos = key_pos[:, None, :] if key_index is None else torch.gather(key_pos, 1, key_index.flatten(1)).view(B, T, S)
    return mask & (positions[..., None] - key_pos < window)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one CPU op instead of eight (set for models on the block kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.device.type == "cpu":  # (an fp32 residual stream: the weight widened, exactly)
            return qgemm.ops().rms_norm(x, self.weight.to(x.dtype), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the `linear` and Llama-3 `rope_scaling` variants; `local`: those
    of the sliding-window layers of a model with their own base (Gemma 3: 10,000 unscaled, 1M globally)."""
    dim = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    # on CPU even while a skeleton is built on the meta device (callers move it where the model is)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        # Q, K and V as one matrix (set by `fuse_qkv`): one pass over the activations instead of three
        self.qkv_proj: nn.Module | None = None
        # rope and attention as one CPU op each (models on the block kernels): rope bit-identical to the float
        # path, attention tiled over 64-key blocks, each query by a fixed recipe (`kernels/csrc/ops/attention.cpp`)
        self.fused = False
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        # per-head norms of q and k before rope (Qwen3, Gemma 3)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.arch.qk_norm else None
        # scores are scaled by head_dim ** -0.5 in every kernel: another scale (Gemma's query_pre_attn_scalar)
        # enters as a factor on q
        scalar = config.query_pre_attn_scalar
        self.q_factor = None if scalar in (None, self.head_dim) else (self.head_dim / scalar) ** 0.5

    def fuse_qkv(self, qkv_proj: nn.Module) -> None:
        """Use one module computing concat(q, k, v) in place of q_proj, k_proj and v_proj."""
        self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = qkv_proj, None, None, None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, head_dim]
        sin: torch.Tensor,  # [B, T, head_dim]
        cache: KVCache,
        write_slots: torch.Tensor | None,  # [B, T] cache slots of the new tokens, or None: rows' slots are a slice
        mask: torch.Tensor,  # [B, T, S] bool, True where a query may attend key s (of key_index, if given)
        key_index: torch.Tensor | None = None,  # [B, T, S] the cache slot of each query's key s (tree passes)
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        fused = self.fused and x.device.type == "cpu"
        if fused:
            q, k = qgemm.ops().rope(q, cos, sin), qgemm.ops().rope(k, cos, sin)
        else:
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if self.q_factor is not None:
            q = q * self.q_factor

        S = mask.shape[-1]
        k_cache, v_cache = cache.keys[self.layer_idx], cache.values[self.layer_idx]
        if write_slots is None:  # one row, or rows of equal length: the next T slots of each
            write_slots = cache.lengths[0] + torch.arange(T, device=x.device).expand(B, T)
        page, offset = cache.locate(write_slots)  # [B, T] each
        cache.store(self.layer_idx, page, offset, k, v)
        if fused:  # (the whole cache: each query reads the slots it sees, through its row's pages)
            # q in the cache's dtype (a Q8_0 cache: any), the output in x's, as the fused layer op does
            q = q if k_cache.dtype in (torch.int8, q.dtype) else q.to(k_cache.dtype)
            out = qgemm.ops().attention(q, k_cache, v_cache, mask, key_index, cache.page_table(B, S)).to(x.dtype)
        else:
            keys, values = cache.gather(k_cache, B, S), cache.gather(v_cache, B, S)  # [B, KV, S, D]
            if x.device.type == "cuda":
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask[:, None], enable_gqa=True
                ).transpose(1, 2)
            elif key_index is not None:
                out = self._exact_tree_attention(q, keys, values, mask, key_index)
            else:
                out = self._exact_attention(q, keys, values, mask)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))

    def _exact_attention(self, q, keys, values, mask):
        """Row-invariant attention: a query's bits do not depend on the pass that computes it (how many queries,
        which batch rows, how many key slots the pass holds). Every matmul has one shape for a given key count:
        QUERY_BLOCK queries (padded) of one row, over the key slots up to their last visible one in whole
        KEY_BLOCKs; bf16 matmuls, softmax in fp32. A matmul over more queries, or over more (masked) key blocks,
        may take another kernel and round differently (bf16, from ~600 keys on: a verified token's K/V then
        differed from its prefilled K/V, which a prefix-cache hit reuses).

        Example: a 6-token pass after 700 committed tokens makes two calls, queries 0..3 over 704 slots and
        queries 4..5 over 768, each padded to QUERY_BLOCK queries: the calls that decoding tokens 700..705 one
        at a time makes, query for query.

        q: [B, T, H, D]; keys, values: [B, KV, S, D]; mask: [B, T, S]. Returns [B, T, H, D].
        """
        B, T, H, D = q.shape
        KV, Q = self.num_kv_heads, QUERY_BLOCK
        seen = (mask * torch.arange(1, mask.shape[-1] + 1, device=mask.device)).amax(-1)  # [B, T] last visible + 1
        slots = (-(-seen // KEY_BLOCK) * KEY_BLOCK).tolist()
        out = q.new_empty(B, T, H, D)
        for b in range(B):
            for ts in _runs(slots[b], Q):  # queries of row b with the same key count, Q at most
                s, n = slots[b][ts[0]], len(ts)
                qs = q.new_zeros(Q, KV, H // KV, D)
                qs[:n] = q[b, ts].view(n, KV, H // KV, D)
                visible = mask[b, ts[:1] * Q, :s].clone()  # [Q, s]: pads see what the first query sees
                visible[:n] = mask[b, ts, :s]
                scores = torch.matmul(qs.transpose(0, 1).flatten(1, 2), keys[b, :, :s].transpose(-1, -2)).float()
                scores = (scores * D ** -0.5).view(KV, Q, -1, s).masked_fill(~visible[None, :, None], float("-inf"))
                probs = torch.softmax(scores, dim=-1).to(q.dtype).flatten(1, 2)  # [KV, Q * G, s]
                heads = torch.matmul(probs, values[b, :, :s]).view(KV, Q, -1, D)[:, :n]  # [KV, n, G, D]
                out[b, ts] = heads.transpose(0, 1).reshape(n, H, D)
        return out

    def _exact_tree_attention(self, q, keys, values, mask, key_index):
        """Attention of tree nodes, each over its own keys gathered into the layout of a chain.

        A node's keys are the committed prefix, then its ancestors and itself in depth order: the same
        slots, in the same order, that decoding its path one token at a time would attend. Each node is
        then computed by the very call a one-token decode step makes (batched matmuls over the nodes
        took another kernel and rounded differently). q: [B, T, H, D]; keys, values: [B, KV, S, D];
        mask, key_index: [B, T, S]. Returns [B, T, H, D].
        """
        B, T = q.shape[:2]
        rows = torch.arange(B, device=q.device)[:, None]
        out = []
        for t in range(T):
            slots = key_index[:, t]  # [B, S]
            k = keys[rows, :, slots].transpose(1, 2)  # [B, KV, S, D]
            v = values[rows, :, slots].transpose(1, 2)
            out.append(self._exact_attention(q[:, t:t + 1], k, v, mask[:, t:t + 1]))
        return torch.cat(out, dim=1)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one matrix (set by `fuse_gate_up`)
        self.act = ACTIVATIONS[config.hidden_act]

    def fuse_gate_up(self, gate_up_proj: nn.Module) -> None:
        """Use one module computing concat(gate, up) in place of gate_proj and up_proj."""
        self.gate_up_proj, self.gate_proj, self.up_proj = gate_up_proj, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, QuantLinear) and x.device.type == "cpu":  # as the fused layer op: gate and
            # up in bf16, the output in x's dtype (an fp32 residual stream)
            gate, up = self.gate_up_proj(x, out_dtype=torch.bfloat16).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up, out_dtype=x.dtype)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router scores the experts of each token, softmax in fp32,
    the top `num_experts_per_tok` are run and their outputs added, weighted by their probabilities (renormalized
    to sum 1 if `norm_topk_prob`) rounded to the activations' dtype, as transformers computes it.

    Each token's experts are its own: a token's output never depends on the other tokens of the pass (the
    experts' matrices keep a row's bits whatever rows run with it, and a token's expert outputs are added in
    expert order from zero). So a verification pass of K tokens routes each as decoding it alone would, and
    reads the union of their experts.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts [N, top_k] of each row of x [N, hidden] and their weights [N, top_k] (x's dtype)."""
        logits = self.gate(x)
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(flat)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # ascending: each row adds its experts in expert order
            rows, k = torch.where(chosen == e)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, k, None])
        return out.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MoE(config) if config.is_moe(layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Llama's norm before the MLP; with sandwich norms (Gemma 3) the norm of attention's output, and two more
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sliding = config.is_sliding(layer_idx)
        self.gelu = config.hidden_act == "gelu_tanh"

        # (models on the block kernels, `fuse`) the whole layer as one CPU op: its weights and settings
        self.fused_args: tuple | None = None

    def fuse(self) -> None:
        """Run this layer as one CPU op (`kernels/csrc/ops/decoder_layer.cpp`, the same ops in the same order: the
        same bits) when its norms, rope and attention are fused and its matrices are `QuantLinear`s; a layer of
        routed experts stays op by op."""
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, MoE):
            return
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not (attn.fused and self.input_layernorm.fused and all(isinstance(m, QuantLinear) for m in linears)):
            return
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        if self.sandwich:
            norms += [self.pre_feedforward_layernorm.weight, self.post_feedforward_layernorm.weight]
        qkv, o, gate_up, down = linears
        self.fused_args = (norms, self.input_layernorm.eps, qkv.kernel_blocks, qkv.kernel_types, qkv.bias,
                           o.kernel_blocks, o.kernel_types, gate_up.kernel_blocks, gate_up.kernel_types,
                           down.kernel_blocks, down.kernel_types)
        q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        self.fused_family = {"q_norm": q_norm, "k_norm": k_norm, "gelu": self.gelu, "q_factor": attn.q_factor or 1.0}

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                 slots: torch.Tensor) -> None:
        """Only the K/V of inputs x [B, T, hidden] (rope's cos, sin [B, T, head_dim]), written to cache slots
        [B, T]: what `forward` writes for them, by the same ops, without computing their outputs (a last
        layer of which only the last input's output is wanted: an EAGLE head reading a prompt)."""
        attn = self.self_attn
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        if attn.qkv_proj is not None:
            _, k, v = attn.qkv_proj(h).split(attn.qkv_sizes, dim=-1)
        else:
            k, v = attn.k_proj(h), attn.v_proj(h)
        k = k.reshape(B, T, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(B, T, attn.num_kv_heads, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        if attn.fused and x.device.type == "cpu":
            k = qgemm.ops().rope(k, cos, sin)
        else:
            k = k * cos.unsqueeze(2) + rotate_half(k) * sin.unsqueeze(2)
        cache.reserve_slots(slots)
        page, offset = cache.locate(slots)
        cache.store(attn.layer_idx, page, offset, k, v)

    def forward(self, x, cos, sin, cache, write_slots, mask, key_index=None, slots=None):
        """`slots` [B, T]: the new tokens' cache slots (for the fused layer; `write_slots` or the rows' next ones)."""
        if self.fused_args is not None and x.device.type == "cpu":
            idx, attn = self.self_attn.layer_idx, self.self_attn
            return qgemm.ops().decoder_layer(x, *self.fused_args, cos, sin, cache.keys[idx], cache.values[idx],
                                             slots, mask, key_index, attn.num_heads, attn.num_kv_heads,
                                             cache.page_table(x.shape[0], mask.shape[-1]), **self.fused_family)
        if self.sandwich:
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, cache, write_slots, mask, key_index))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, write_slots, mask, key_index)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The stack (named `model` inside `Transformer`, as in Hugging Face checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class _SkipInit(TorchFunctionMode):
    """Within it (this thread, this block only), the modules' random initializers return their tensor as it is."""

    SKIPPED = {nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_, torch.Tensor.uniform_, torch.Tensor.normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_skeleton():
    """Build modules on the meta device without running their initializers: the values are replaced anyway,
    and random init on meta tensors first imports torch's reference ops (~1.7 s at start-up). Torch function
    modes, scoped to the block and the thread: nothing process-wide is patched."""
    with torch.device("meta"), _SkipInit():
        yield


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        use_one_bf16_matmul_kernel()  # a row's bits must not depend on the rows computed with it (models/cpu.py)
        self.config = config
        self.kv_format = "auto"  # its K/V caches' rows (`--kv-cache-dtype`): the activations' dtype, or "q8_0"
        # the residual stream's dtype between layers, when not the activations' (fp32 on the fused layers of the
        # block kernels: as llama.cpp, only the matrices' inputs are rounded, to 8 bits, and the cache's rows)
        self.residual_dtype: torch.dtype | None = None
        self.edge_dtype: torch.dtype | None = None  # `dtype`, where the norms are kept wider (`residual_dtype`)
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.register_buffer("inv_freq_local", None, persistent=False)  # the sliding layers' own (`set_rope`)

    def set_rope(self) -> None:
        """The rope frequencies, on the model's device (after its parameters are in place)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.device)
        if self.config.rope_local_theta is not None and self.config.layer_types:
            self.inv_freq_local = rope_inv_freq(self.config, local=True).to(self.device)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> "Transformer":
        """Build without allocating twice: parameters are the state dict's tensors (dtype and device too)."""
        with meta_skeleton():
            model = cls(config)
        model.load_state_dict(state_dict, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        model.set_rope()
        return model.eval()

    def output_rows(self, ids: torch.Tensor) -> nn.Module:
        """An output layer of lm_head's rows `ids` only (sorted token ids), for `forward(head=...)`: the
        logits of those tokens (on the block kernels, the very bits lm_head gives them) at a fraction of
        lm_head's cost."""
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head.select_rows(ids.cpu())
        rows = nn.Linear(self.config.hidden_size, len(ids), bias=False, device=self.device, dtype=self.lm_head.weight.dtype)
        with torch.no_grad():
            rows.weight.copy_(self.lm_head.weight[ids.to(self.device)])
        return rows.eval()

    # what other modules (draft heads, training) read of the target, without reaching into its layers
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [*ids.shape, hidden] of `ids` (an embedding table or its blocks: rows by lookup)."""
        return self.model.embed_tokens(ids)

    def embedding_table(self) -> torch.Tensor:
        """The whole embedding table as a new float32 tensor [vocab, hidden]."""
        embed = self.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            return embed.dequantize_rows(torch.arange(self.config.vocab_size))
        return embed.weight.detach().float().clone()

    def output_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """The output layer's rows [len(ids), hidden] for token ids `ids`, in float32 (dequantized)."""
        lm_head = self.lm_head
        if isinstance(lm_head, nn.Linear):
            return lm_head.weight.detach()[ids].float()
        if isinstance(lm_head, QuantLinear):  # GGUF blocks
            return lm_head.dequantize_rows(ids.cpu()).to(ids.device)
        if isinstance(lm_head, Int8Linear):  # per-channel scales
            return lm_head.qweight[ids].float() * lm_head.scale[ids].float()[:, None]
        raise ValueError(f"no float rows for an output layer of type {type(lm_head).__name__}")

    @property
    def on_block_kernels(self) -> bool:
        """Its output layer runs on GGUF blocks (`output_rows` then gives block rows with the same bits)."""
        return isinstance(self.lm_head, QuantLinear)

    @property
    def final_norm_weight(self) -> torch.Tensor:
        return self.model.norm.weight

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype at the model's edges: its K/V caches' rows, the hidden states it returns (the
        norms' dtype, but on the block kernels, whose norms and residual stream are fp32: `residual_dtype`)."""
        return self.edge_dtype or self.model.norm.weight.dtype

    def new_cache(self, batch_size: int, capacity: int, num_pages: int | None = None) -> KVCache:
        """A cache for this model, in `kv_format` ("auto": the activations' dtype; "q8_0": 8-bit rows; set by
        `--kv-cache-dtype`)."""
        return KVCache(self.config, batch_size, capacity, self.dtype, self.device, num_pages, self.kv_format)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64 rope positions
        cache: KVCache,
        mask: torch.Tensor | None = None,  # [B, T, T] bool among the new tokens; None: causal
        num_logits: int | None = None,  # logits for the last n tokens only; None: all T
        logit_rows: int | None = None,  # logits for the first n rows of the batch only; None: all B
        return_hidden: bool = False,
        head: nn.Module | None = None,  # the output layer, if not lm_head (a draft's vocabulary: `output_rows`)
        feature_layers: tuple[int, ...] = (),  # with return_hidden: these layers' outputs too (EAGLE-3 heads)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B or logit_rows, n, vocab] (fp32) and, if asked, the final hidden states [B, T, hidden],
        preceded along the last axis by the outputs of `feature_layers` (the residual stream after those
        layers, as computed: [B, T, (len(feature_layers) + 1) * hidden]). Example: feature_layers (2, 14) ->
        the outputs of layers 2 and 14, then the final normed states.

        The new tokens of row b go to cache slots `cache.lengths[b] + t`; they see every committed slot
        of their row and the new tokens that `mask` allows (causal by default; a tree mask for tree drafts).
        """
        B, T = tokens.shape
        wide = self.residual_dtype or self.dtype
        cos, sin, write_slots, full_mask, key_index = attention_inputs(cache, positions, mask, self.inv_freq, wide)
        h = self.model.embed_tokens(tokens)
        if self.config.arch.embed_scale:
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        h = h.to(wide)
        rope = {False: (cos, sin)}  # by `sliding`: the sliding layers' rope and mask where they have their own
        masks = {False: full_mask}
        if self.inv_freq_local is not None:
            rope[True] = rope_tables(positions, self.inv_freq_local, wide)
        if self.config.layer_types:
            masks[True] = window_mask(full_mask, positions, cache.lengths, key_index, self.config.sliding_window)
        slots = write_slots  # (what the fused layers need; rows of equal length: the next T slots of each)
        if slots is None and any(layer.fused_args is not None for layer in self.model.layers):
            slots = cache.lengths[0] + torch.arange(T, device=tokens.device).expand(B, T)
        features = []
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope.get(layer.sliding, rope[False])
            h = layer(h, cos, sin, cache, write_slots, masks[layer.sliding], key_index, slots)
            if i in feature_layers:
                features.append(h.to(self.dtype))
        h = self.model.norm(h)
        scored = h if logit_rows is None else h[:logit_rows]
        logits = (head or self.lm_head)(scored if num_logits is None else scored[:, -num_logits:]).float()
        if not return_hidden:
            return logits
        h = h.to(self.dtype)
        return logits, (torch.cat([*features, h], -1) if features else h)
