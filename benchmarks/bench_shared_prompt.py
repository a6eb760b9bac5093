"""Requests that share a long system prompt (or each bring their own: --distinct) and each allow most of the
context for their answer (as coding agents send them: Claude Code asks `max_tokens` 32000), sent at once to
`specdec serve` with its defaults; with --old-src, the same against another checkout's server, one server at a
time, side by side in one run.

    .venv/bin/python benchmarks/bench_shared_prompt.py [--old-src ../old/src] [--system-tokens 2000]
        [--requests 3] [--max-tokens 30000] [--answers short|long|code] [--distinct] [--serve-args "..."]

The system prompt is Python standard-library source (about `system-tokens` tokens; with --distinct a different
module for each request); each request asks a different question about it (greedy, streamed; short and long
answers stop at a blank line, code answers at the end of the model's turn). A server that admits a request by
the pages it may come to hold (prompt + max_tokens) runs one such request at a time where the pool holds one;
one that admits by what requests hold now (and preempts the newest when they outgrow the pool) runs them
together. Per request: time to first token, time to its end, completion and cached tokens, preemptions. Prints
a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import httpx

from load_test import start_server

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = {  # --answers: short ones (a sentence), or longer ones (a few sentences each)
    "short": ("In one sentence, what is the file above for?",
              "Name the first class the file above defines, and nothing else.",
              "In one sentence, which modules does the file above import?",
              "In one sentence, what would a user of the file above call first?"),
    "long": ("In three sentences, what is the file above for?",
             "In three sentences, describe the first class the file above defines.",
             "In three sentences, describe how the file above handles errors.",
             "In three sentences, what would a user of the file above call first, and why?"),
    "code": ("Write a short Python example that uses the first class the file above defines.",
             "Write a Python function that calls the first function the file above defines, with a docstring.",
             "Write a pytest test for the first function the file above defines.",
             "Write a short Python example that uses the file above."),
}
MODULES = ("argparse.py", "textwrap.py", "json/decoder.py", "shlex.py")  # --distinct: one per request


def system_prompt(tokens: int, module: str = "argparse.py") -> str:
    """About `tokens` tokens of a standard-library module (3.5 characters a token, as code runs)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / module).read_text()[:int(3.5 * tokens)]


def ask(url: str, system: str, question: str, max_tokens: int, t0: float, out: dict, stop: list[str]) -> None:
    body = {"model": "qwen2.5-coder-1.5b-instruct", "temperature": 0, "max_tokens": max_tokens, "stop": stop,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                out.setdefault("ttft", time.perf_counter() - t0)
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                out["cached_tokens"] = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
            if chunk.get("specdec"):
                out["preemptions"] = chunk["specdec"].get("preemptions", 0)
    out["total"] = time.perf_counter() - t0
    out["text"] = "".join(text)


def run_side(src: Path, args, log_dir: str) -> list[dict]:
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(src)
    try:
        proc, url = start_server(args.serve_args.split(), log_dir)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    try:
        httpx.post(f"{url}/v1/chat/completions", timeout=600, json={  # warm-up
            "model": "qwen2.5-coder-1.5b-instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
        results = [{"question": q} for q in QUESTIONS[args.answers][:args.requests]]
        systems = [system_prompt(args.system_tokens, MODULES[i] if args.distinct else MODULES[0])
                   for i in range(len(results))]
        stop = [] if args.answers == "code" else ["\n\n"]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=ask, args=(url, system, r["question"], args.max_tokens, t0, r, stop))
                   for r, system in zip(results, systems)]
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.2 if i == 0 else 0)  # the first one first
        for t in threads:
            t.join()
        return results
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-src", type=Path, help="another checkout's src/ to compare with")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=3, choices=range(1, 5))
    ap.add_argument("--answers", choices=sorted(QUESTIONS), default="short")
    ap.add_argument("--max-tokens", type=int, default=30000)
    ap.add_argument("--distinct", action="store_true", help="a different system prompt for each request")
    ap.add_argument("--serve-args", default="", help="flags for both servers, e.g. --no-enable-prefix-caching")
    args = ap.parse_args()
    sides = {"new": ROOT / "src"} | ({"old": args.old_src.resolve()} if args.old_src else {})
    results = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for name, src in sides.items():
            results[name] = run_side(src, args, log_dir)
    print(f"{args.requests} requests at once, {'distinct system prompts' if args.distinct else 'a system prompt'} "
          f"of ~{args.system_tokens} tokens, max_tokens {args.max_tokens}, {args.answers} answers; `specdec serve` "
          f"{args.serve_args or 'defaults'}; {os.cpu_count()} cores")
    print("| server | request | prompt tokens (cached) | first token (s) | done (s) | completion tokens | preempted |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for i, r in enumerate(rows):
            print(f"| {name} | {i + 1} | {r.get('prompt_tokens')} ({r.get('cached_tokens')}) | {r['ttft']:.1f} | "
                  f"{r['total']:.1f} | {r.get('completion_tokens')} | {r.get('preemptions', '-')} |")
    same = len(sides) == 2 and [r["text"] for r in results["new"]] == [r["text"] for r in results["old"]]
    print(json.dumps({"bench": "shared_prompt", "requests": args.requests, "answers": args.answers,
                      "distinct": args.distinct, "serve_args": args.serve_args,
                      "system_tokens": args.system_tokens,
                      "max_tokens": args.max_tokens, "same_text": same,
                      "results": {n: [{k: v for k, v in r.items() if k != "text"} for r in rows]
                                  for n, rows in results.items()}}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
