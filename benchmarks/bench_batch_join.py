"""Prompts joining a running batch: riding in its pass always (the engine before) against the choice of
`prefill.ride_pays` (riding, or a pass of their own where padding the running rows to the prompt's chunk
costs more), side by side in one run.

    .venv/bin/python benchmarks/bench_batch_join.py [--humaneval 8] [--max-tokens 48] [--batch 8]
        [--methods plain,auto] [--threads 2]

HumanEval's first N prompts (the evaluation half) are sent at once to an `LLM` with `max_num_seqs` = --batch,
greedy, for each speculation method (plain: `--num-speculative-tokens 0`; auto: the defaults) and each way of
reading the prompts that join while others decode; every (method, way) gets a fresh `LLM`, the two ways of a
method one after the other. Per run: wall seconds for all outputs, output tokens/s, steps, prompt tokens that
rode in the running sequences' passes and that were read in passes of their own while others decoded, and
whether the outputs equal plain decoding's (the first run's). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.prompts import dataset_prompts

TARGET = "qwen2.5-coder-1.5b-instruct"
WAYS = ("ride always", "ride_pays")


def run(method: str, way: str, prompts: list[str], args) -> dict:
    spec = {"num_speculative_tokens": 0} if method == "plain" else {}
    llm = LLM(TARGET, max_num_seqs=args.batch, max_model_len=4096, **spec)
    engine = llm.engine
    if way == "ride always":
        engine.planner.ride_pays = lambda tokens: True
    rode, own, steps = [0], [0], [0]
    ride, step = engine.planner.rode, engine.step

    def counted_ride(riding):
        rode[0] += len(riding.rows.tokens)
        return ride(riding)

    def counted_step():
        out = step()
        own[0] += engine.plan.fed.tokens
        steps[0] += 1
        return out

    engine.planner.rode, engine.step = counted_ride, counted_step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"method": method, "way": way, "seconds": round(seconds, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 3), "steps": steps[0], "prompt_tokens_rode": rode[0],
            "prompt_tokens_own_passes": own[0], "outputs": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--humaneval", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--methods", default="plain,auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.prompt for p in dataset_prompts("humaneval")[:args.humaneval]]
    results = [run(method, way, prompts, args) for method in args.methods.split(",") for way in WAYS]
    reference = results[0]["outputs"]
    print(f"{'method':8} {'prompt reading':14} {'seconds':>8} {'tokens/s':>9} {'steps':>6} {'rode':>6} "
          f"{'own':>6} {'vs ride always':>15} {'outputs = first':>16}")
    for r in results:
        always = next(x for x in results if x["method"] == r["method"] and x["way"] == "ride always")
        r["speedup_vs_ride_always"] = round(always["seconds"] / r["seconds"], 3)
        r["outputs_equal"] = r.pop("outputs") == reference
        print(f"{r['method']:8} {r['way']:14} {r['seconds']:8.1f} {r['tokens_per_s']:9.2f} {r['steps']:6d} "
              f"{r['prompt_tokens_rode']:6d} {r['prompt_tokens_own_passes']:6d} "
              f"{r['speedup_vs_ride_always']:14.2f}x {str(r['outputs_equal']):>16}")
    print(json.dumps({"benchmark": "batch_join", "humaneval": args.humaneval, "max_tokens": args.max_tokens,
                      "batch": args.batch, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
