"""Attention at depth on the real target (block kernels), side by side with llama.cpp on the same GGUF.

    .venv/bin/python benchmarks/bench_attention.py [--depth 8192] [--threads 2] [--old-src ../main/src]
        [--llama-bench PATH] [--skip-llama] [--itl] [--itl-only] [--q8]

For each specdec tree given (this checkout's `src`, and with --old-src another checkout's, e.g. the kernel
before this one), a worker process loads the target (`gguf` blocks, bf16 activations) and measures:
    prefill    tokens/s of a `depth`-token prompt fed in chunks of 512 (the engine's `prefill_chunk`)
    decode     tokens/s of plain one-token steps at that depth
    verify     the time of a 4-row pass (a verification of 3 drafted tokens) over that of a 1-row one
    op         (--op-only: nothing else) the attention op alone at the target's shapes: 1, 4, 512 rows
    itl        (--itl, --itl-only) a short request's inter-token latency, alone and while a `depth`-token
               prompt is read beside it in the engine, plain greedy decoding: in 512-token chunks of its own
               (`prefill_itl_factor=None`), and riding in the short request's passes (the default)
and, unless --skip-llama, llama-bench -p DEPTH and -n 32 -d DEPTH on the same GGUF with the same threads.
With --q8, this checkout again with an 8-bit K/V cache (`--kv-cache-dtype q8_0`), side by side.
The machine may be shared: compare the ratios measured in one run. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import checkouts

TARGET = "qwen2.5-coder-1.5b-instruct"
ROOT = Path(__file__).resolve().parents[1]
LLAMA_BENCH = ROOT.parent / "shared" / "tools" / "llama.cpp-avx2" / "llama-bench"
CHUNK = 512


def worker(depth: int, itl: bool, fill: bool = False, itl_only: bool = False, kv_format: str = "auto") -> dict:
    import torch

    from specdec.api import load_model

    model, tokenizer, _ = load_model(TARGET, torch.bfloat16, torch.device("cpu"), quantization="gguf")
    model.kv_format = kv_format  # (a checkout before the 8-bit cache ignores it: "auto" only)
    if itl_only:
        return inter_token_latency(model, tokenizer, depth)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 30000, (1, depth + 8), generator=gen)  # random ids: attention cost is the same
    cache = model.new_cache(1, depth + 64)
    out = {}
    with torch.inference_mode():
        model(prompt[:, :8], torch.arange(8)[None], cache, num_logits=1)  # warm up (kernels built, pages in)
        cache.lengths[0] = 0
        if fill:  # random K/V for the first depth - 512 slots (attention costs the same), then the last chunk
            for layer in range(len(cache.keys)):
                for kv in (cache.keys[layer], cache.values[layer]):
                    if kv.dtype == torch.int8:  # (Q8_0 rows: the encoding of random values)
                        from specdec.models.kv_cache import q8_encode

                        shape = (*kv.shape[:-1], model.config.head_dim)
                        kv.copy_(q8_encode(torch.randn(shape, generator=gen, dtype=torch.bfloat16)))
                    else:
                        kv.normal_(generator=gen)
            cache.lengths[0] = depth - CHUNK
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(cache.lengths[0], depth, CHUNK):
            n = min(CHUNK, depth - s)
            model(prompt[:, s:s + n], torch.arange(s, s + n)[None], cache, num_logits=1)
            cache.advance(0, n)
        fed = CHUNK if fill else depth
        out["last_chunk_tok_s" if fill else "prefill_tok_s"] = fed / (time.perf_counter() - t0)
        out["last_chunk_cpu_s" if fill else "prefill_cpu_s"] = time.process_time() - c0

        def pass_time(rows: int, repeats: int) -> tuple[float, float]:
            wall, cpu = [], []
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                model(prompt[:, depth:depth + rows], torch.arange(depth, depth + rows)[None], cache, num_logits=rows)
                wall.append(time.perf_counter() - t)  # (not advanced: the next pass writes the same slots)
                cpu.append(time.process_time() - c)
            return min(wall), min(cpu)

        one, four = [], []
        for _ in range(4):  # taking turns, so that load from other processes falls on both
            one.append(pass_time(1, 3))
            four.append(pass_time(4, 3))
        (w1, _), (w4, _) = min(one), min(four)
        out["decode_tok_s"] = 1 / w1
        out["verify4_over_1"], out["verify4_over_1_cpu"] = w4 / w1, min(c for _, c in four) / min(c for _, c in one)
        out["pass1_ms"], out["pass4_ms"] = 1e3 * w1, 1e3 * w4
        out["pass1_cpu_ms"], out["pass4_cpu_ms"] = 1e3 * min(c for _, c in one), 1e3 * min(c for _, c in four)
    del cache
    if itl:
        out.update(inter_token_latency(model, tokenizer, depth))
    return out


def op_worker(depth: int, threads: int) -> dict:
    """The attention op alone at the target's shapes (12 query heads on 2 K/V heads of 128, bf16) over
    `depth` cached keys: 1 row, 4 rows, a 512-row prefill chunk; wall and process CPU milliseconds (the
    CPU time is what a loaded machine distorts least), best of a few."""
    import torch

    from specdec.kernels import qgemm

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, depth + CHUNK, 128, generator=g).bfloat16()
    values = torch.randn(1, 2, depth + CHUNK, 128, generator=g).bfloat16()
    out = {}
    for rows, repeats in ((1, 7), (4, 7), (CHUNK, 2)):
        q = torch.randn(1, rows, 12, 128, generator=g).bfloat16()
        visible = torch.ones(1, rows, depth + rows, dtype=torch.bool).tril_(depth)
        qgemm.ops().attention(q, keys, values, visible, None)
        wall, cpu = [], []
        for _ in range(repeats):
            w, c = time.perf_counter(), time.process_time()
            qgemm.ops().attention(q, keys, values, visible, None)
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
        out[f"op_{rows}rows_ms"], out[f"op_{rows}rows_cpu_ms"] = 1e3 * min(wall), 1e3 * min(cpu)
    out["op_verify4_over_1_cpu"] = out["op_4rows_cpu_ms"] / out["op_1rows_cpu_ms"]
    return out


def inter_token_latency(model, tokenizer, depth: int) -> dict:
    """A short request decoding greedily, alone, then while a `depth`-token prompt joins and is read beside
    it: in chunks of 512 tokens of its own (`prefill_itl_factor=None`, the engine before), and riding in the
    short request's steps (the default, factor 2): the mean and worst gap between its tokens, and the time
    the long prompt took to its first token."""
    import torch

    from specdec.engine import Engine

    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(1000, 30000, (depth,), generator=g).tolist()
    out = {}
    for name, factor in (("own chunks", None), ("riding", 2.0)):
        engine = Engine(model, tokenizer, max_batch_size=2, max_model_len=depth + 256, prefill_itl_factor=factor)
        out.update({f"{key} ({name})": value for key, value in _gaps(engine, long_prompt).items()})
    return out


def _gaps(engine, long_prompt: list[int]) -> dict:
    import time

    from specdec.config import SamplingParams

    def gaps(with_long: bool, n: int) -> list[float]:
        engine.add_request(f"short{n}", list(range(1000, 1032)), SamplingParams(max_tokens=40, temperature=0.0,
                                                                                 ignore_eos=True))
        stamps = []
        while engine.has_unfinished_requests():
            if with_long and len(stamps) == 4:
                engine.add_request(f"long{n}", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
            outs = engine.step()
            if any(o.request_id == f"short{n}" and o.new_token_ids for o in outs):
                stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps[4:], stamps[5:])]  # once the long prompt is in (or would be)

    alone = gaps(False, 0)
    t0 = time.perf_counter()
    shared = gaps(True, 1)
    while engine.has_unfinished_requests():  # (the long prompt's first token, if the short one ended first)
        engine.step()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"itl_alone_ms": 1e3 * mean(alone), "itl_during_prefill_ms": 1e3 * mean(shared),
            "itl_worst_during_prefill_ms": 1e3 * max(shared), "long_prompt_done_s": time.perf_counter() - t0}


def run_worker(src: Path, args, kv_format: str = "auto") -> dict:
    flags = [f"--{name.replace('_', '-')}" for name in ("itl", "op_only", "fill", "itl_only") if getattr(args, name)]
    return checkouts.run_worker(__file__, src, args.threads, "--depth", str(args.depth), "--threads",
                                str(args.threads), "--kv-cache-dtype", kv_format, *flags)


def llama_bench(path: Path, gguf: Path, depth: int, threads: int) -> dict:
    """llama-bench's pp`depth` and tg32 at depth `depth` (tokens/s)."""
    out = {}
    for key, flags in (("prefill_tok_s", ["-p", str(depth), "-n", "0"]),
                       ("decode_tok_s", ["-p", "0", "-n", "32", "-d", str(depth)])):
        done = subprocess.run([str(path), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *flags],
                              capture_output=True, text=True, check=True)
        out[key] = json.loads(done.stdout)[0]["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old-src", type=Path, help="another checkout's src/ (the kernel to compare with)")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--itl", action="store_true", help="also the inter-token latency under a long prefill")
    ap.add_argument("--itl-only", action="store_true", help="only that (no prefill or pass timings, no llama.cpp)")
    ap.add_argument("--op-only", action="store_true", help="only the attention op alone (no model, no llama.cpp)")
    ap.add_argument("--fill", action="store_true", help="random K/V up to depth - 512 instead of a prefill; "
                    "then time the last 512-token chunk and the passes at depth (minutes, not the hour of a loaded machine)")
    ap.add_argument("--q8", action="store_true", help="also this checkout with --kv-cache-dtype q8_0 (column q8_0)")
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)  # (a worker's)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(op_worker(args.depth, args.threads) if args.op_only else
                         worker(args.depth, args.itl, args.fill, args.itl_only, args.kv_cache_dtype)))
        return
    load = os.getloadavg()
    sides = {"new": ROOT / "src"} | ({"old": args.old_src.resolve()} if args.old_src else {})
    results = {name: run_worker(src, args) for name, src in sides.items()}
    if args.q8:
        results["q8_0"] = run_worker(ROOT / "src", args, "q8_0")
    if not (args.skip_llama or args.op_only or args.itl_only) and args.llama_bench.is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from specdec.models.store import resolve_model

        results["llama.cpp"] = llama_bench(args.llama_bench, resolve_model(TARGET), args.depth, args.threads)
    keys = [*(f"op_{r}rows{c}_ms" for r in (1, 4, CHUNK) for c in ("", "_cpu")), "op_verify4_over_1_cpu",
            "prefill_tok_s", "prefill_cpu_s", "last_chunk_tok_s", "last_chunk_cpu_s", "decode_tok_s", "verify4_over_1", "verify4_over_1_cpu", "pass1_ms", "pass4_ms", "pass1_cpu_ms", "pass4_cpu_ms",
            *(f"{key} ({name})" for name in ("own chunks", "riding") for key in
              ("itl_alone_ms", "itl_during_prefill_ms", "itl_worst_during_prefill_ms", "long_prompt_done_s"))]
    print(f"depth {args.depth}, {args.threads} threads, load average at start {load[0]:.2f} (uptime)")
    print(f"{'':42}" + "".join(f"{name:>12}" for name in results))
    for key in keys:
        if any(key in r for r in results.values()):
            print(f"{key:42}" + "".join(f"{r[key]:12.2f}" if key in r else f"{'-':>12}" for r in results.values()))
    if "old" in results:
        for key in keys:
            if key in results["new"] and key in results["old"]:
                print(f"old / new {key:30}{results['old'][key] / results['new'][key]:12.2f}")
    if "q8_0" in results:
        for key in keys:
            if key in results["new"] and key in results["q8_0"]:
                print(f"q8_0 / new {key:29}{results['q8_0'][key] / results['new'][key]:12.2f}")
    if "llama.cpp" in results:
        for key in [k for k in ("prefill_tok_s", "decode_tok_s") if k in results["new"]]:
            print(f"new / llama.cpp {key:14}{results['new'][key] / results['llama.cpp'][key]:12.2f}")
    print(json.dumps({"depth": args.depth, "threads": args.threads, "load_average": load[0], **results}))


if __name__ == "__main__":
    main()
