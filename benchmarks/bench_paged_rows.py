"""Paged K/V rows against rows that trade number for length: one request longer than a short row, beside short
ones, on the default target.

    .venv/bin/python benchmarks/bench_paged_rows.py [--old-src ../old/src] [--long-tokens 1000] [--short 3]

An engine of 4 sequences whose K/V share 2048 slots (4 rows of 512 before paged K/V), greedy, plain decoding,
no prefix cache: request "long" (a 40-token prompt and `--long-tokens` to write: longer than a row of 512)
arrives first, then `--short` requests of 24 tokens, each with its own 40-token prompt. With rows that trade
number for length, the long one runs alone in one row of 2048 and the short ones wait for it; with paged K/V
they run beside it while their lengths fit. For each specdec tree given (this checkout's `src`, and with
--old-src another checkout's), a worker process times when each request finishes (seconds from the first
step). Prints a table, then one JSON line; the outputs of the trees are compared token for token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import checkouts

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen2.5-coder-1.5b-instruct"


def worker(long_tokens: int, short: int) -> dict:
    import time

    from specdec.api import LLM
    from specdec.config import SamplingParams

    llm = LLM(MODEL, max_model_len=2048, enable_prefix_caching=False)
    engine = llm._engine(None, None, 4, row_tokens=2048)  # plain decoding, 4 sequences sharing 2048 slots
    prompts = {"long": list(range(1000, 1040)), **{f"short{i}": list(range(2000 + 100 * i, 2040 + 100 * i))
                                                   for i in range(short)}}
    for rid, prompt in prompts.items():
        n = long_tokens if rid == "long" else 24
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    start, done, tokens, batch = time.perf_counter(), {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = round(time.perf_counter() - start, 2)
                tokens[out.request_id] = list(out.token_ids)
        batch = max(batch, len(engine.running))
    return {"finished_s": done, "largest_batch": batch, "tokens": tokens}


def run_worker(src: Path, args) -> dict:
    return checkouts.run_worker(__file__, src, args.threads, "--long-tokens", str(args.long_tokens),
                                "--short", str(args.short))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-src", type=Path, help="another checkout's src/ (the code to compare with)")
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.long_tokens, args.short)))
        return
    trees = {"new": ROOT / "src", **({"old": args.old_src.resolve()} if args.old_src else {})}
    results = {name: run_worker(src, args) for name, src in trees.items()}
    ids = list(results["new"]["finished_s"])
    print(f"{'tree':5} {'largest batch':>13} " + " ".join(f"{rid + ' done (s)':>15}" for rid in ids))
    for name, r in results.items():
        print(f"{name:5} {r['largest_batch']:13} " + " ".join(f"{r['finished_s'][rid]:15}" for rid in ids))
    same = all(r["tokens"] == results["new"]["tokens"] for r in results.values())
    print(json.dumps({"long_tokens": args.long_tokens, "short": args.short, "same_tokens": same,
                      **{name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}}))


if __name__ == "__main__":
    main()
