"""Tensor parallelism on torch.distributed whose greedy output is bit-identical to one process.

Megatron's split (column-parallel Q/K/V and gate/up, row-parallel o_proj and down_proj, one all-reduce
after each) sums partial products across ranks, so a logit's bits depend on the number of ranks. Here no
rank ever adds another's numbers: every matrix is split by its *output* features, and each matmul reads
its whole input (gathered across ranks where it was split), so every output element is the same full dot
product, in the same kernel, as in one process; ranks only concatenate (all-gather). docs/tensor-parallel.md
has the design, its cost (about twice Megatron's bytes on the wire) and the next steps.

    q_proj, k_proj, v_proj   rows of the rank's heads (heads split evenly)         no communication
    attention                the rank's heads, over its own K/V cache (its KV heads) no communication
    o_proj                   gather the heads' outputs, then rows of its hidden share, gather those
    gate_proj, up_proj       rows of its intermediate share                         no communication
    down_proj                gather the intermediate, then rows of its hidden share, gather those
    lm_head                  rows of its vocabulary share, gather the logits
    norms, residuals, embeddings: replicated (the same inputs give the same bits on every rank)

The layers run `specdec.models.llama`'s own forward code: `shard_model` only swaps their matrices for
sharded ones and sets the attention's head counts to the rank's.

Example (2 ranks, Qwen2.5-Coder-1.5B: 12 heads, 2 KV heads, hidden 1536, intermediate 8960): rank 1 holds
heads 6..11 and KV head 1, rows 768..1535 of o_proj and down_proj, rows 4480..8959 of gate and up.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdec.models.llama import Attention, MLP, Transformer


def gather_last(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order (an exact copy: no arithmetic).
    It travels as bytes, which every backend carries whatever the dtype (gloo has no bf16)."""
    world = dist.get_world_size(group)
    wire = x.contiguous().view(torch.uint8)
    parts = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(parts, wire, group=group)
    return torch.cat([p.view(x.dtype) for p in parts], dim=-1)


class OutputShard(nn.Module):
    """The rows [rank * n, (rank + 1) * n) of a linear layer (the last shard zero-padded), gathered across
    ranks; with `gather_input`, its input is first gathered too (it was split by the previous layer).
    Its output equals the unsharded layer's, bit for bit, where the matmul kernel's result for an output
    column does not depend on which other columns it computes (bf16 on CPU: tests/test_tensor_parallel.py)."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, gather_input: bool,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.out_features, self.gather_input, self.group = linear.out_features, gather_input, group
        share = -(-linear.out_features // world)
        self.weight = nn.Parameter(_rows(linear.weight, rank, share), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(_rows(linear.bias, rank, share), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = gather_last(x, self.group)
        return gather_last(F.linear(x, self.weight, self.bias), self.group)[..., :self.out_features]


def shard_model(model: Transformer, rank: int, world: int, group: dist.ProcessGroup | None = None) -> Transformer:
    """This rank's part of `model` (a copy; the model is left whole). Its `new_cache` holds the rank's KV heads
    only. Needs heads, KV heads and the intermediate size divisible by `world`."""
    config = model.config
    for name, n in (("num_attention_heads", config.num_attention_heads),
                    ("num_key_value_heads", config.num_key_value_heads), ("intermediate_size", config.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs {name} ({n}) divisible by {world}")
    if model.model.layers[0].self_attn.qkv_proj is not None or model.model.layers[0].mlp.gate_up_proj is not None:
        raise ValueError("shard_model takes a model with separate q/k/v and gate/up matrices (not fused)")
    local = copy.deepcopy(model)
    local.config = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                                       num_key_value_heads=config.num_key_value_heads // world,
                                       intermediate_size=config.intermediate_size // world)
    for layer in local.model.layers:
        _shard_attention(layer.self_attn, rank, world, group)
        _shard_mlp(layer.mlp, rank, world, group)
    local.lm_head = OutputShard(model.lm_head, rank, world, gather_input=False, group=group)
    return local


def _shard_attention(attn: Attention, rank: int, world: int, group) -> None:
    attn.num_heads //= world
    attn.num_kv_heads //= world
    attn.qkv_sizes = [attn.num_heads * attn.head_dim] + [attn.num_kv_heads * attn.head_dim] * 2
    attn.q_proj = _row_slice(attn.q_proj, rank, attn.num_heads * attn.head_dim)
    attn.k_proj = _row_slice(attn.k_proj, rank, attn.num_kv_heads * attn.head_dim)
    attn.v_proj = _row_slice(attn.v_proj, rank, attn.num_kv_heads * attn.head_dim)
    attn.o_proj = OutputShard(attn.o_proj, rank, world, gather_input=True, group=group)


def _shard_mlp(mlp: MLP, rank: int, world: int, group) -> None:
    share = mlp.gate_proj.out_features // world
    mlp.gate_proj = _row_slice(mlp.gate_proj, rank, share)
    mlp.up_proj = _row_slice(mlp.up_proj, rank, share)
    mlp.down_proj = OutputShard(mlp.down_proj, rank, world, gather_input=True, group=group)


def _row_slice(linear: nn.Linear, rank: int, share: int) -> nn.Linear:
    """Rows [rank * share, (rank + 1) * share) of `linear`, whose output stays on this rank."""
    out = nn.Linear(linear.in_features, share, bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(_rows(linear.weight, rank, share), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(_rows(linear.bias, rank, share), requires_grad=False)
    return out


def _rows(t: torch.Tensor, rank: int, share: int) -> torch.Tensor:
    """Rows [rank * share, (rank + 1) * share) of `t`, zero rows past its end."""
    rows = t.detach()[rank * share:(rank + 1) * share].clone()
    if rows.shape[0] < share:
        rows = torch.cat([rows, rows.new_zeros(share - rows.shape[0], *rows.shape[1:])])
    return rows
