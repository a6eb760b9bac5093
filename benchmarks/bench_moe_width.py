"""What a verification pass of M rows costs a mixture-of-experts target, against a dense target that reads as
many weights per token: each row picks its own experts, so an M-row pass reads the union of the rows' experts,
where a dense pass reads the same matrices for any M.

    .venv/bin/python benchmarks/bench_moe_width.py [--experts 64] [--top-k 8] [--layers 8] [--reps 5]

Both models are random-weight (no MoE checkpoint is at hand here), Q4_0 on the block kernels, shaped like a
Qwen3-MoE scaled down: hidden 1024, 16 heads of 64 (4 KV heads), experts of 384 (the dense one: one MLP of
top_k x 384). Passes of M = 1..8 new tokens after a 64-token context, the two models taking turns, the best of
`--reps`; also the mean number of distinct experts a layer reads per pass, and what uniform routing would give,
E * (1 - (1 - k / E) ** M). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specdec.config import ModelConfig
from specdec.models.llama import MoE
from specdec.models.qlinear import Q4_0
from specdec.testing.tiny_arch import random_block_model

WIDTHS = (1, 2, 3, 4, 5, 6, 8)
CONTEXT = 64


def configs(experts: int, top_k: int, layers: int) -> tuple[ModelConfig, ModelConfig]:
    shape = dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    moe = ModelConfig("Qwen3MoeForCausalLM", intermediate_size=384 * top_k, num_experts=experts,
                      num_experts_per_tok=top_k, moe_intermediate_size=384, **shape)
    dense = ModelConfig("Qwen3ForCausalLM", intermediate_size=384 * top_k, **shape)
    return moe, dense


def pass_time(model, width: int, seed: int, counting: list[bool] | None = None) -> float:
    """Seconds of one pass of `width` new tokens after a CONTEXT-token prompt (`counting[0]` set during it)."""
    cache = model.new_cache(1, CONTEXT + 16)
    ids = torch.randint(0, 4096, (CONTEXT + width,), generator=torch.Generator().manual_seed(seed))
    model(ids[None, :CONTEXT], torch.arange(CONTEXT)[None], cache)
    cache.advance(0, CONTEXT)
    if counting is not None:
        counting[0] = True
    start = time.perf_counter()
    model(ids[None, CONTEXT:], torch.arange(CONTEXT, CONTEXT + width)[None], cache)
    elapsed = time.perf_counter() - start
    if counting is not None:
        counting[0] = False
    return elapsed


def experts_read(model, width: int, reps: int) -> float:
    """Mean distinct experts per MoE layer in a pass of `width` rows (hooks on the routers)."""
    counts, counting = [], [False]

    def hook(moe):
        def count(module, args, out):
            if counting[0]:
                counts.append(len(torch.topk(out.float(), moe.top_k, dim=-1).indices.unique()))
        return count

    hooks = [m.gate.register_forward_hook(hook(m)) for m in model.modules() if isinstance(m, MoE)]
    for rep in range(reps):
        pass_time(model, width, 1000 + rep, counting)
    for h in hooks:
        h.remove()
    return sum(counts) / len(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    moe_cfg, dense_cfg = configs(args.experts, args.top_k, args.layers)
    models = {"moe": random_block_model(moe_cfg, Q4_0), "dense": random_block_model(dense_cfg, Q4_0)}
    best = {name: {w: float("inf") for w in WIDTHS} for name in models}
    for rep in range(args.reps):
        for w in WIDTHS:
            for name, model in models.items():
                with torch.no_grad():
                    best[name][w] = min(best[name][w], pass_time(model, w, rep))
    with torch.no_grad():
        read = {w: experts_read(models["moe"], w, 2) for w in WIDTHS}
    E, k = args.experts, args.top_k
    uniform = {w: E * (1 - (1 - k / E) ** w) for w in WIDTHS}
    print(f"\nCPU: {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}; "
          f"{E} experts, top {k}, {args.layers} layers, Q4_0\n")
    print("| rows M | dense pass, ms | x M=1 | MoE pass, ms | x M=1 | experts read / layer | uniform routing |")
    print("|---|---|---|---|---|---|---|")
    for w in WIDTHS:
        d, m = best["dense"][w], best["moe"][w]
        print(f"| {w} | {d * 1e3:.2f} | {d / best['dense'][1]:.2f} | {m * 1e3:.2f} | {m / best['moe'][1]:.2f} | "
              f"{read[w]:.1f} | {uniform[w]:.1f} |")
    print(json.dumps({"benchmark": "moe_width", "experts": E, "top_k": k, "layers": args.layers,
                      "dense_ms": {w: round(best["dense"][w] * 1e3, 3) for w in WIDTHS},
                      "moe_ms": {w: round(best["moe"][w] * 1e3, 3) for w in WIDTHS},
                      "experts_read": {w: round(read[w], 2) for w in WIDTHS}}))


if __name__ == "__main__":
    main()
