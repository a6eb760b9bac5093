"""What a prefix-cache hit costs when its blocks are copied and when they are mapped: the default target's
K/V cache (its shapes and dtype, from the GGUF's metadata; no weights are loaded), a row of `depth` tokens
saved to the prefix cache, then restored into `rows` new rows, side by side in one run.

    .venv/bin/python benchmarks/bench_prefix_map.py [--depths 4100 10250 30730] [--rows 4] [--repeats 5]

(A depth past a whole block leaves a tail: the restored rows' first writes land in its shared page.)

Per depth and way (copied: blocks in the prefix cache's own pool, as before; mapped: blocks are the pages
the row wrote, `PrefixCache(mapped=...)`), the median over repeats of:
  - save: the finished row's blocks and tail into the prefix cache;
  - restore: one hit, the blocks and tail into an empty row;
  - first write: the restored row's next pass reserving its next slot (mapped: a copy of the shared tail page);
and the K/V memory the cached prefix and `rows` rows restored from it hold after their first writes (the
pool's pages in use, and the copied blocks in use: both ways set the same memory aside for the cache).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.engine.prefix_cache import PrefixCache
from specdec.models.gguf_file import GGUFFile
from specdec.models.kv_cache import KVCache
from specdec.models.loading import gguf_config
from specdec.models.store import resolve_model

TARGET = "qwen2.5-coder-1.5b-instruct"
MiB = 1024 ** 2


def measure(config, depth: int, rows: int, mapped: bool, repeats: int) -> dict:
    """One way at one depth: times (s, medians) and memory (bytes)."""
    pages = KVCache.pages_for(depth + 1)
    blocks = pages
    cache = KVCache(config, rows + 1, pages * 16 + 64, torch.bfloat16,
                    num_pages=(rows + 1) * (pages + 1) + blocks)
    cache.prefix_pages = blocks
    cache.reserve(rows, depth)  # the finished request's row: random K/V
    gen = torch.Generator().manual_seed(0)
    for kv in cache.keys + cache.values:
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
    cache.advance(rows, depth)
    tokens = list(range(depth))
    times: dict[str, list[float]] = {"save": [], "restore": [], "first write": []}
    for _ in range(repeats):
        pc = PrefixCache({"target": cache}, blocks, 16, mapped=("target",) if mapped else ())
        keys = pc.keys(tokens, tail=True)
        tail = depth % 16
        t0 = time.perf_counter()
        pc.save("target", keys, cache, rows, tail=tail)
        times["save"].append(time.perf_counter() - t0)
        whole = keys[:depth // 16]
        for row in range(rows):
            t0 = time.perf_counter()
            found = pc.lookup(whole)
            pc.load("target", found, cache, row, tail=pc.tail("target", whole, tokens[len(found) * 16:] + [0]))
            t1 = time.perf_counter()
            cache.reserve(row, depth + 1)
            t2 = time.perf_counter()
            times["restore"].append(t1 - t0)
            times["first write"].append(t2 - t1)
        in_use = cache.num_pages - len(cache.free)  # the source row's pages are the mapped blocks; copied, not
        if not mapped:  # (the source row would have left: its pages are not counted; the blocks in use are)
            in_use += len(pc.blocks) - len(cache.pages[rows])
        memory = in_use * (cache.nbytes // cache.num_pages)  # (a block of 16 tokens holds what a page does)
        for row in range(rows):
            cache.clear(row)
        pc.clear()
    return {"depth": depth, "way": "mapped" if mapped else "copied",
            **{name: statistics.median(ts) for name, ts in times.items()}, "memory_bytes": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[4100, 10250, 30730])
    ap.add_argument("--rows", type=int, default=4, help="rows restored from the one cached prefix")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    config = gguf_config(GGUFFile(resolve_model(TARGET)))
    results = [measure(config, depth, args.rows, mapped, args.repeats)
               for depth in args.depths for mapped in (False, True)]
    print(f"{TARGET}: {config.num_hidden_layers} layers x {config.num_key_value_heads} K/V heads x "
          f"{config.head_dim}, bf16; {torch.get_num_threads()} threads; {args.rows} rows restored from one prefix")
    print("| depth | way | save (ms) | restore (ms) | first write (ms) | K/V held: prefix + rows (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['depth']} | {r['way']} | {1e3 * r['save']:.2f} | {1e3 * r['restore']:.2f} | "
              f"{1e3 * r['first write']:.2f} | {r['memory_bytes'] / MiB:.0f} |")
    print(json.dumps({"bench": "prefix_map", "target": TARGET, "rows": args.rows, "repeats": args.repeats,
                      "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
