"""Suffix decoding on agentic code work, side by side with plain decoding, prompt lookup and the other
methods in one run (`specdec bench`'s measurement, `specdec.bench.compare`: one engine per method for the
whole run, the methods taking turns prompt by prompt; greedy, every output checked against plain decoding's).

    .venv/bin/python benchmarks/bench_suffix.py [--edits 6] [--sessions 2] [--other 4] [--methods ...]

Three workloads, on code nobody here wrote (functions of this interpreter's standard library, HumanEval and
Spec-Bench prompts):

- edits: a function and an edit request (rename a parameter, add type hints, a one-line docstring, a check)
  whose answer repeats most of the function;
- sessions: an agent's turns on one function: an edit; the same conversation asking for a second edit (the
  prompt holds the first answer); then a fresh request with the original function asking for both edits at
  once (what the second answer holds is in no prompt: only the global trie of past outputs has it);
- other: HumanEval and Spec-Bench prompts that are not edits (64 tokens).

`suffix` and `suffix:local` (the request's own trie only) measure what the global trie adds. Prints a table
per workload, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.compare import MethodRun, decode, summarize
from specdec.bench.methods import parse_method
from specdec.bench.prompts import Prompt, dataset_prompts
from specdec.bench.report import method_table

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
REPLY = "Reply with the complete updated function in one ```python block, and nothing else."
EDITS = [  # (function, edit request)
    ("fnmatch.filter", "Rename the parameter `pat` to `pattern`."),
    ("textwrap.indent", "Rename the parameter `prefix` to `margin`."),
    ("html.escape", "Rename the parameter `s` to `text`."),
    ("colorsys.rgb_to_hls", "Add type hints to the parameters and the return value."),
    ("string.capwords", "Add a check at the start that raises TypeError if `s` is not a str."),
    ("statistics.median", "Replace the docstring with a one-line docstring."),
]
SESSIONS = [  # (function, first edit, second edit)
    ("glob.escape", "Rename the parameter `pathname` to `path`.", "Add type hints to the parameter and the return value."),
    ("colorsys.rgb_to_hsv", "Rename `maxc` to `max_component` and `minc` to `min_component`.",
     "Add type hints to the parameters and the return value."),
]
METHODS = f"plain,ngram:k=8,suffix:k=24:adaptive,suffix:k=24:adaptive:local,suffix:k=24,draft:{DRAFT}:k=4"


def source(name: str) -> str:
    module, _, attr = name.rpartition(".")
    return inspect.getsource(getattr(importlib.import_module(module), attr))


def ask(code: str, request: str) -> dict:
    return {"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\n{request} {REPLY}"}


def encode(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode_parts(llm.tokenizer.render_chat(messages))


def max_tokens_for(llm: LLM, code: str) -> int:
    return len(llm.tokenizer.encode(code)) + 64  # room for the whole function and a bit more


def measure(methods, engines, ids: list[list[int]], budgets: list[int], runs: list[MethodRun] | None = None
            ) -> list[MethodRun]:
    """Each method decodes each prompt (greedy, its own max_tokens), the methods taking turns prompt by prompt;
    added to `runs` when given."""
    runs = runs or [MethodRun(m, 0) for m in methods]
    for prompt_ids, budget in zip(ids, budgets):
        params = SamplingParams(temperature=0, max_tokens=budget)
        for run, engine in zip(runs, engines):
            out = decode(engine, prompt_ids, params)
            run.metrics.append(out.metrics)
            run.outputs.append(out.token_ids)
            m = out.metrics
            print(f"  {run.method.name}: {len(prompt_ids)} prompt tokens, {m.emitted_tokens} tokens, "
                  f"{m.tokens_per_second:.2f} tokens/s, {m.mean_acceptance_length:.2f} per pass, same as plain: "
                  f"{out.token_ids == runs[0].outputs[-1]}", file=sys.stderr, flush=True)
    return runs


def sessions(llm: LLM, methods, engines, count: int) -> tuple[list[MethodRun], list[Prompt]]:
    """Three turns per session (see the module's docstring); each turn's prompt is built from plain decoding's
    answers, which every method's equal (checked)."""
    runs, prompts = None, []
    chosen = SESSIONS[:count]
    for turn in range(3):
        ids, budgets = [], []
        for s, (name, first, second) in enumerate(chosen):
            code = source(name)
            if turn == 0:
                messages = [ask(code, first)]
            elif turn == 1:
                answer = llm.tokenizer.decode(runs[0].outputs[s], skip_special_tokens=True)
                messages = [ask(code, first), {"role": "assistant", "content": answer},
                            {"role": "user", "content": f"{second} {REPLY}"}]
            else:
                messages = [ask(code, f"{first} {second}")]
            ids.append(encode(llm, messages))
            budgets.append(max_tokens_for(llm, code))
            prompts.append(Prompt(messages=tuple(messages), category=f"turn {turn + 1}"))
        runs = measure(methods, engines, ids, budgets, runs)
    return runs, prompts


def row(s) -> dict:
    return {"method": s.name, "tokens_per_s": round(s.tokens_per_s, 3), "speedup": round(s.speedup, 3),
            "tokens_per_pass": round(s.tokens_per_pass, 3), "acceptance_rate": round(s.pooled.acceptance_rate, 4),
            "identical": s.identical, "speedup_by_category": {k: round(v, 3) for k, v in s.speedup_by_category.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edits", type=int, default=len(EDITS))
    parser.add_argument("--sessions", type=int, default=len(SESSIONS))
    parser.add_argument("--other", type=int, default=4, help="HumanEval and Spec-Bench prompts, half each")
    parser.add_argument("--other-max-tokens", type=int, default=64)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's); on a shared, "
                                                    "loaded machine 1 keeps passes from waiting on each other")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    llm = LLM(TARGET, max_model_len=2048)
    methods = [parse_method(m, TARGET) for m in args.methods.split(",")]
    assert methods[0].spec is None, "plain first: the baseline"
    engines = [llm.engine_for(m.spec) for m in methods]
    results = {}

    edits = [(source(name), request) for name, request in EDITS[:args.edits]]
    prompts = [Prompt(messages=(ask(code, request),), category="edit") for code, request in edits]
    for engine in engines:  # first calls pay one-time costs: not measured
        decode(engine, prompts[0].token_ids(llm.tokenizer)[-64:], SamplingParams(temperature=0, max_tokens=4))
    runs = measure(methods, engines, [p.token_ids(llm.tokenizer) for p in prompts],
                   [max_tokens_for(llm, code) for code, _ in edits])
    results["edits"] = summarize(runs, prompts, greedy=True)

    if args.sessions:
        runs, prompts = sessions(llm, methods, engines, args.sessions)
        results["sessions"] = summarize(runs, prompts, greedy=True)

    if args.other:
        other = dataset_prompts("humaneval")[:(args.other + 1) // 2] + dataset_prompts("spec-bench")[:args.other // 2]
        runs = measure(methods, engines, [p.token_ids(llm.tokenizer) for p in other],
                       [args.other_max_tokens] * len(other))
        results["other"] = summarize(runs, other, greedy=True)

    for name, summaries in results.items():
        print(f"\n## {name}\n")
        print("\n".join(method_table(summaries)))
        cats = sorted(summaries[0].speedup_by_category)
        if len(cats) > 1:
            print("\nspeedup by category: " + "; ".join(
                f"{s.name}: " + ", ".join(f"{c} {s.speedup_by_category[c]:.2f}x" for c in cats) for s in summaries))
    suffix = next((e.proposer for m, e in zip(methods, engines) if m.name.startswith("suffix:") and
                   "local" not in m.name), None)  # the first global one
    print(json.dumps({"benchmark": "suffix", "target": TARGET, "seconds": round(time.perf_counter() - t0, 1),
                      "suffix_cache_bytes": suffix.memory_bytes if suffix is not None else None,
                      **{name: [row(s) for s in summaries] for name, summaries in results.items()}}))


if __name__ == "__main__":
    main()
