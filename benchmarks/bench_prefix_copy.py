"""The prefix cache's copies: saving a long sequence's K/V into the cache's blocks and restoring them into a row.

    .venv/bin/python benchmarks/bench_prefix_copy.py [--tokens 10240] [--threads 2] [--old-src ../old/src]

Both run inside the engine's step (a prompt is saved once it is in, and a sequence when it leaves; a hit is
restored before its first pass), so while they run the other sequences wait. For each specdec tree given
(this checkout's `src`, and with --old-src another checkout's), a worker process builds the default
target's K/V shapes (28 layers, 2 K/V heads of 128, bf16; random values: a copy costs the same) for
`--tokens` tokens plus a tail of 5, and times, best of `--repeats`:
    save        the chain of blocks and the tail, into a fresh pool (its blocks handed out in order)
    save_scattered  the same into blocks handed out in a shuffled order (a pool that has evicted)
    load        the chain and the tail back into an empty row
and checks that the restored slots hold the same bits. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import checkouts

ROOT = Path(__file__).resolve().parents[1]


def worker(tokens: int, repeats: int) -> dict:
    import random
    import time
    from types import SimpleNamespace

    import torch

    from specdec.engine.prefix_cache import PrefixCache
    from specdec.models.kv_cache import KVCache

    config = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=2, head_dim=128, hidden_size=1536,
                             num_attention_heads=12)
    ids = list(range(tokens + 5))
    cache = KVCache(config, 1, tokens + 64, torch.bfloat16)
    paged = hasattr(cache, "reserve")  # (a checkout from before paged K/V: rows laid out whole)
    if paged:
        cache.reserve(0, tokens + 5)
    for t in cache.keys + cache.values:
        t.normal_()

    def first(c, layer_cache, n):  # the first n slots of row 0: [kv_heads, n, head_dim]
        return c.gather(layer_cache, 1, n)[0] if paged else layer_cache[0, :, :n]
    out = {"save_s": [], "save_scattered_s": [], "load_s": [], "same_bits": True}
    for _ in range(repeats):
        for shuffled in (False, True):
            pc = PrefixCache({"target": cache}, num_blocks=tokens // 16 + 8)
            order = list(range(pc.num_blocks))
            random.Random(0).shuffle(order)
            handed = iter(order)
            allocate = pc._allocate

            def shuffled_allocate(key, keep, size):
                block = allocate(key, keep, size)
                if block is not None:
                    block.id = next(handed)
                return block

            if shuffled:
                pc._allocate = shuffled_allocate
            keys = pc.keys(ids, None, tail=True)
            t0 = time.perf_counter()
            pc.save("target", keys, cache, 0, tail=5)
            out["save_scattered_s" if shuffled else "save_s"].append(time.perf_counter() - t0)
            chain, tail = pc.lookup(keys[:-1]), pc.tail("target", keys[:-1], ids[len(keys[:-1]) * 16:])
            row = KVCache(config, 1, tokens + 64, torch.bfloat16)
            t0 = time.perf_counter()
            n = pc.load("target", chain, row, 0, tail=tail)
            out["load_s"].append(time.perf_counter() - t0)
            out["same_bits"] &= n == tokens + 5 and all(
                torch.equal(first(cache, a, n), first(row, b, n))
                for a, b in zip(cache.keys + cache.values, row.keys + row.values))
    return {k: min(v) if isinstance(v, list) else v for k, v in out.items()}


def run_worker(src: Path, args) -> dict:
    return checkouts.run_worker(__file__, src, args.threads, "--tokens", str(args.tokens), "--repeats", str(args.repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=10240)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--old-src", type=Path, help="another checkout's src/ (the code to compare with)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(worker(args.tokens, args.repeats)))
        return
    trees = {"new": ROOT / "src", **({"old": args.old_src.resolve()} if args.old_src else {})}
    result = {"tokens": args.tokens, "threads": args.threads, "load_average": os.getloadavg()[0]}
    for name, src in trees.items():  # (taking turns would not help: each worker is a few seconds)
        result[name] = run_worker(src, args)
    print(f"{'':18}" + "".join(f"{name:>12}" for name in trees))
    for key in ("save_s", "save_scattered_s", "load_s", "same_bits"):
        print(f"{key:18}" + "".join(f"{str(round(result[n][key], 3)):>12}" for n in trees))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
