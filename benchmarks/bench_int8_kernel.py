"""Benchmark the row-invariant int8 kernel against torch's CPU kernels for the few-row shapes of decoding.

    python benchmarks/bench_int8_kernel.py [--quick] [--shapes 8960x1536,...] [--rows 1,2,4,6,9,16]

Shapes are NxK (out_features x in_features).  Prints a table of ms per call and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from specdec.kernels import int8_gemm


def bench(fn, min_time: float, min_iters: int = 3) -> float:
    fn()  # warm up
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    times.sort()
    return 1e3 * times[len(times) // 2]  # median, ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8960x1536,1536x8960,1536x1536,151936x1536")
    p.add_argument("--rows", default="1,2,4,6,9,16")
    p.add_argument("--min-time", type=float, default=0.15, help="seconds per measurement")
    p.add_argument("--no-float", action="store_true", help="skip the fp32/bf16 F.linear baselines")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]

    t0 = time.perf_counter()
    ok = int8_gemm.available()
    compile_s = time.perf_counter() - t0
    print(f"threads={torch.get_num_threads()} kernel_available={ok} load_s={compile_s:.1f}"
          + ("" if ok else f" reason={int8_gemm.unavailable_reason()}"))

    results = []
    hdr = f"{'shape NxK':>13} {'M':>3} {'ours':>8} {'int8pack':>9} {'fp32':>8} {'bf16':>8}  ours/ours(M=1)"
    print(hdr)
    print("-" * len(hdr))
    for N, K in shapes:
        torch.manual_seed(0)
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s = (torch.rand(N) * 0.01 + 1e-3).to(torch.bfloat16)
        w32 = w16 = None
        if not args.no_float:
            w32 = q.float() * s.float()[:, None]
            w16 = w32.bfloat16()
        base = None
        for M in rows:
            x = torch.randn(M, K).bfloat16()
            row = {"N": N, "K": K, "M": M}
            row["ours"] = bench(lambda: int8_gemm.int8_linear(x, q, s), args.min_time) if ok else float("nan")
            row["int8pack"] = bench(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s), args.min_time)
            if not args.no_float:
                xf = x.float()
                row["fp32"] = bench(lambda: F.linear(xf, w32), args.min_time)
                row["bf16"] = bench(lambda: F.linear(x, w16), args.min_time)
            else:
                row["fp32"] = row["bf16"] = float("nan")
            base = row["ours"] if M == rows[0] else base
            print(f"{N:>6}x{K:<6} {M:>3} {row['ours']:8.3f} {row['int8pack']:9.3f} {row['fp32']:8.3f} "
                  f"{row['bf16']:8.3f}  {row['ours'] / base:5.2f}x")
            results.append(row)
        del q, w32, w16
    print(json.dumps({"bench": "int8_kernel", "threads": torch.get_num_threads(), "load_s": round(compile_s, 2),
                      "results": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                                  for r in results]}))


if __name__ == "__main__":
    main()
