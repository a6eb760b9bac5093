"""The prefix cache's disk tier across a restart: a long prompt read cold, then by a new process on the same folder.

    .venv/bin/python benchmarks/bench_prefix_disk.py [--tokens 10000] [--threads 2]

Three engines on the default target, one after another in this process (each loaded anew, as a restarted server
is): RAM only (the cold prefill without the disk tier's writes), then with the disk tier in a new folder (cold:
the prompt read and its blocks written), then again on that folder (a restart: the blocks read back). Each
answers the same prompt (HumanEval prompts joined to about `--tokens` tokens) with 8 greedy tokens; the table
gives each one's time to its answer, the tokens it restored and from where, and the answers' equality. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch

from specdec.api import DEFAULT_TARGET, LLM
from specdec.bench.prompts import dataset_prompts
from specdec.config import SamplingParams


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    texts = [p.prompt for p in dataset_prompts("humaneval")]
    ids: list[int] = []
    i = 0
    while len(ids) < tokens:
        ids += llm.tokenizer.encode(texts[i % len(texts)] + "\n\n", add_special_tokens=False)
        i += 1
    return ids[:tokens]


def answer(llm: LLM, prompt: list[int]) -> tuple[float, list[int], int, int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - t0, out.token_ids, out.metrics.cached_tokens, out.metrics.disk_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="specdec-kv-bench-")
    rows = []
    prompt = None
    for label, disk in (("RAM only, cold", False), ("disk tier, cold", True), ("disk tier, after a restart", True)):
        t0 = time.perf_counter()
        llm = LLM(DEFAULT_TARGET, max_model_len=args.tokens + 64, prefix_cache_disk=disk, prefix_cache_dir=folder)
        load = time.perf_counter() - t0
        prompt = prompt or long_prompt(llm, args.tokens)
        seconds, ids, cached, from_disk = answer(llm, prompt)
        used = llm.prefix_disk.usage() if llm.prefix_disk is not None else 0
        rows.append({"run": label, "load_s": round(load, 2), "answer_s": round(seconds, 2), "cached": cached,
                     "from_disk": from_disk, "disk_bytes": used, "ids": ids})
        print(f"{label}: {seconds:.2f} s", flush=True)
        del llm
        gc.collect()
    cold, written, restarted = rows
    print(f"\nprompt: {len(prompt)} tokens; folder {folder}")
    print("\n| run | load, s | to the answer (8 tokens), s | tokens restored (from disk) | disk tier, MiB | same answer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['load_s']:.2f} | {r['answer_s']:.2f} | {r['cached']} ({r['from_disk']}) | "
              f"{r['disk_bytes'] / 2**20:.0f} | {r['ids'] == cold['ids']} |")
    print(f"\nafter a restart: {restarted['answer_s'] / cold['answer_s']:.3f}x the cold answer's time; writing the "
          f"blocks: {written['answer_s'] / cold['answer_s']:.3f}x")
    print(json.dumps({
        "prompt_tokens": len(prompt), "cold_s": cold["answer_s"], "cold_with_writes_s": written["answer_s"],
        "restarted_s": restarted["answer_s"], "restart_vs_cold": round(restarted["answer_s"] / cold["answer_s"], 4),
        "restored_tokens": restarted["cached"], "from_disk": restarted["from_disk"],
        "disk_bytes": restarted["disk_bytes"], "same_answer": all(r["ids"] == cold["ids"] for r in rows),
        "threads": args.threads}))


if __name__ == "__main__":
    main()
