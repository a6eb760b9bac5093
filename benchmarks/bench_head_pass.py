"""What one EAGLE head pass costs beside one target pass, with the head's layer in each form it can run in.

    .venv/bin/python benchmarks/bench_head_pass.py [--heads NAME] [--context 256] [--repeats 30]

Forms: `bf16` (torch matmuls, the layer's attention in Python), `q8_0` (each matrix Q8_0 on the block
kernels, the rest torch: how shipped heads ran before), `q8_0 fused` (Q/K/V and gate/up as one matrix each,
the whole layer as one kernel op, as the target's layers run). Passes timed, after `--context` committed
pairs in the head's cache: a 2-pair feed (what a step commits), a chain depth (1 node), a tree depth (8
nodes under a tree mask), the output layer over the reduced vocabulary, and a prompt's pairs read in one pass
or as the proposer reads them (their K/V alone, `EagleHead.write_kv`, then the last pair); beside them target
passes of 1 and 3 rows. Median of `--repeats`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from safetensors.torch import load_file

from specdec import LLM
from specdec.heads.files import read_heads_config, resolve_heads
from specdec.heads.modules import _Head, head_class
from specdec.speculative.tree import ancestor_mask

TARGET = "qwen2.5-coder-1.5b-instruct"
PROMPT = 64  # pairs of a prompt read at once


def head_in(form: str, folder, target):
    config = read_heads_config(folder)
    head = head_class(config.method)(config)
    head.load_state_dict(load_file(str(folder / "model.safetensors")))
    head = head.to(dtype=target.dtype).attach(target).requires_grad_(False).eval()
    if form == "q8_0":
        _Head.to_block_kernels(head, target)
    elif form == "q8_0 fused":
        head.to_block_kernels(target)
    return head


def prompt_kv_then_last(head, feats, ids, base: int, cache):
    """What the EAGLE proposer does with a prompt's pairs: their K/V alone, then a pass of the last pair."""
    T = ids.shape[1]
    head.write_kv(feats[:, :-1], ids[:, :-1], torch.arange(base, base + T - 1)[None], cache,
                  torch.arange(base, base + T - 1)[None])
    at = torch.tensor([[base + T - 1]])
    return head(feats[:, -1:], ids[:, -1:], at, cache, torch.arange(cache.capacity)[None, None] <= at, at)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default=f"{TARGET}-eagle3")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(TARGET, max_model_len=2048)
    target, folder = llm.target, resolve_heads(args.heads)
    n = args.context
    ids = torch.randint(0, 30000, (1, n + 8), generator=torch.Generator().manual_seed(0))

    cache = target.new_cache(1, n + 8)
    _, hidden = target(ids[:, :n], torch.arange(n)[None], cache, return_hidden=True)
    cache.advance(0, n)
    rows = {}
    for width in (1, 3):
        rows[f"target pass, {width} row(s)"] = median_ms(
            lambda: target(ids[:, n:n + width], torch.arange(n, n + width)[None], cache), args.repeats)

    parents = [-1, -1, 0, 0, 1, 2, 2, 4]  # an 8-node tree, 3 deep
    tree_mask = ancestor_mask(parents)[1:, 1:][None]
    depth = [0, 0, 1, 1, 1, 2, 2, 2]
    results = {"target": rows}
    for form in ("bf16", "q8_0", "q8_0 fused"):
        head = head_in(form, folder, target)
        feats = hidden.to(head.dtype)  # [1, n, H]
        hcache = head.new_cache(1, n + PROMPT)
        head(feats[:, :n - 3], ids[:, 1:n - 2], torch.arange(n - 3)[None], hcache)
        hcache.advance(0, n - 3)
        base = n - 3
        form_rows = {
            "feed 2 pairs": median_ms(lambda: head(feats[:, base:base + 2], ids[:, base + 1:base + 3],
                                                   torch.arange(base, base + 2)[None], hcache), args.repeats),
            "chain depth (1 node)": median_ms(lambda: head(feats[:, :1], ids[:, :1], torch.tensor([[base]]), hcache,
                                                           mask=torch.ones(1, 1, 1, dtype=torch.bool)), args.repeats),
            "tree depth (8 nodes)": median_ms(lambda: head(feats[:, :8], ids[:, :8],
                                                           torch.tensor([[base + d for d in depth]]), hcache,
                                                           mask=tree_mask), args.repeats),
            "output layer, 8 rows": median_ms(lambda: head.logits(feats[0, :8]), args.repeats),
            f"prompt of {PROMPT} pairs, one pass": median_ms(lambda: head(
                feats[:, :PROMPT], ids[:, 1:PROMPT + 1], torch.arange(base, base + PROMPT)[None], hcache), args.repeats),
            f"prompt of {PROMPT} pairs, K/V alone + last": median_ms(lambda: prompt_kv_then_last(
                head, feats[:, :PROMPT], ids[:, 1:PROMPT + 1], base, hcache), args.repeats),
        }
        results[form] = form_rows
    print(f"context {n} pairs, {args.threads} thread(s), median of {args.repeats} (ms)")
    for group, values in results.items():
        for name, ms in values.items():
            print(f"  {group:12} {name:28} {ms:8.2f}")
    print(json.dumps({"benchmark": "head_pass", "context": n, "threads": args.threads,
                      "ms": {g: {k: round(v, 3) for k, v in vals.items()} for g, vals in results.items()}}))


if __name__ == "__main__":
    main()
